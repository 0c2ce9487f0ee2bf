"""The torch backend: the DALI pipeline's semantics with torch ops (``auto`` on CPUs and for volumes resident on a
GPU, and wherever DALI is not installed).

Where the device cuts and rotates (``pipeline.device_cut.DeviceCutter``), it cuts crops of volumes resident on the
device, on a CUDA stream of its own a batch ahead of training, or rotates a batch the CPU batcher cut and this loader
copied over; no per-sample kernels and no host synchronization. For the same draws the samples equal the DALI
backend's and the numpy reference's (tested).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pipeline.crops import CropBatch, CropBatcher
from pipeline.device_cut import DeviceCutter
from pipeline.sampling import Augmenter, DrawPlan


def pinned_buffer(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array in page-locked host memory (the batcher's buffers for a GPU): it copies to the GPU
    asynchronously and without a staging copy. The array keeps its tensor, and so the memory, alive."""
    return torch.empty(shape, dtype=torch.float32, pin_memory=True).numpy()


class TorchLoader:
    """Iterates over one epoch of (input, target) NCDHW tensors on ``device`` per ``for`` loop.

    Inputs come in ``dtype``, targets in float32, as from ``DaliLoader``, which this mirrors: either
    ``batcher`` cuts the crops on CPU threads, or ``resident`` volumes on ``device`` are cut here (this backend's
    device storage); the first epoch starts at ``first_batch``. With
    ``rotate_on_device`` the device cuts and rotates (``DeviceCutter``), and the batcher must not rotate.
    """

    def __init__(
        self,
        *,
        plan: DrawPlan,
        augmenter: Augmenter,
        device: torch.device,
        dtype: torch.dtype,
        rotate_on_device: bool,
        batcher: CropBatcher | None = None,
        resident: tuple[torch.Tensor, torch.Tensor] | None = None,
        first_epoch: int = 0,
        first_batch: int = 0,
        channels_last: bool = False,
    ) -> None:
        if (batcher is None) == (resident is None):
            raise ValueError("TorchLoader takes a batcher or resident volumes, not both")
        if batcher is not None and batcher.rotate_here == rotate_on_device and plan.rotate:
            raise ValueError("exactly one of the batcher and the device must rotate")
        if resident is not None and not rotate_on_device:
            raise ValueError("resident volumes are cut on the device: rotate_on_device must be set")
        self.plan, self.device, self.dtype = plan, device, dtype
        self.cutter = DeviceCutter(augmenter, plan.crop_size, device) if rotate_on_device else None
        self.batcher, self.resident = batcher, resident
        self.epoch, self.next_batch = first_epoch, first_batch
        self.channels_last = channels_last
        # Batches from the CPU go up on a stream of their own, overlapping the training step on the GPU; batches of
        # resident volumes are cut on one, a batch ahead, the same way.
        on_gpu = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if batcher is not None and on_gpu else None
        self.cut_stream = torch.cuda.Stream(device) if resident is not None and on_gpu else None

    def close(self) -> None:
        """Stop the batcher's threads (where there is one) and the work they had started ahead."""
        if self.batcher is not None:
            self.batcher.close()

    def __len__(self) -> int:
        return self.plan.num_batches

    def _cut_ahead(self, index: int) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Batch ``index`` of resident volumes, queued on the cut stream (on a GPU) with the event that ends it."""
        draws = self.plan.batch_draws(self.epoch, index)
        if self.cut_stream is None:
            args = self.cutter.arguments(draws, cut_already=False)
            return self.cutter(self.resident, args, (self.dtype, torch.float32), channels_last=self.channels_last), None
        with torch.cuda.stream(self.cut_stream):  # the arguments' copy too: ordered with the cut, in its memory
            args = self.cutter.arguments(draws, cut_already=False)
            batch = self.cutter(self.resident, args, (self.dtype, torch.float32), channels_last=self.channels_last)
            cut = torch.cuda.Event()
            cut.record(self.cut_stream)
        return batch, cut

    def _handed_over(self, batch: list[torch.Tensor], cut: torch.cuda.Event | None) -> tuple[torch.Tensor, ...]:
        """The training stream waits for the cut on the GPU, and the allocator keeps the batch's memory until the
        training stream is done with it (it was made on the cut stream)."""
        if cut is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(cut)
            for tensor in batch:
                tensor.record_stream(compute)
        return tuple(batch)

    def _resident_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of resident volumes, each cut while the one before it trains: batch i + 1 is queued on the cut
        stream before batch i is handed over (on a CPU, the same order without streams)."""
        if self.cut_stream is not None:  # what the training stream made (the volumes, the cutter's tables) first
            self.cut_stream.wait_stream(torch.cuda.current_stream(self.device))
        ahead = self._cut_ahead(self.next_batch) if self.next_batch < self.plan.num_batches else None
        for index in range(self.next_batch, self.plan.num_batches):
            current, ahead = ahead, self._cut_ahead(index + 1) if index + 1 < self.plan.num_batches else None
            yield self._handed_over(*current)

    def _batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batcher.get(self.epoch, index)
        if self.copy_stream is not None:
            inputs, targets = self._upload(batch)
        else:  # views of the batcher's buffer (in its memory format), no copy: see __iter__
            inputs, targets = torch.from_numpy(batch.inputs), torch.from_numpy(batch.targets)
        if self.cutter is None:
            return inputs.to(self.dtype), targets
        args = self.cutter.arguments(batch.draws, cut_already=True)
        return self.cutter((inputs, targets), args, (self.dtype, torch.float32), channels_last=self.channels_last)

    def _upload(self, batch: CropBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the GPU, copied from the batcher's pinned buffer on the copy stream, with no host sync.

        The training stream waits for the copy on the GPU; the batcher cuts into that buffer again only
        after the copy is done (the guard); the tensors made on the copy stream are marked as used by the
        training stream, so that the allocator does not hand their memory to the next copy too early.
        """
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            inputs, targets = (
                torch.from_numpy(a).to(self.device, non_blocking=True) for a in (batch.inputs, batch.targets)
            )
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        compute.wait_event(copied)
        for tensor in (inputs, targets):
            tensor.record_stream(compute)
        self.batcher.guard(batch, copied)
        return inputs, targets

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches in order. On a CPU, where the batcher has already cut and rotated them, they are views of its
        ring of buffers: each stays intact while the next one is processed (the ring holds one returned batch
        beyond the one being cut into), so a training step reads it in place; a consumer that keeps batches
        longer clones them."""
        if self.batcher is None:
            yield from self._resident_batches()
        else:
            for index in range(self.next_batch, self.plan.num_batches):
                yield self._batch(index)
        self.epoch, self.next_batch = self.epoch + 1, 0
