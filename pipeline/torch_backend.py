"""The torch backend: the DALI pipeline's semantics with torch ops, for machines without DALI, and the
device-storage path of both backends.

Where the device cuts and rotates, a batch is one gather per tensor (``DeviceCutter``): crops of volumes
resident on the device, or of a batch the CPU batcher cut and this loader copied over, rotated and laid out
(channels-last included) in the same pass, with no per-sample kernels and no host synchronization. For the
same draws the samples equal the DALI backend's and the numpy reference's (tested).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pipeline.crops import CropBatch, CropBatcher
from pipeline.rotations import ROTATIONS, VectorGroups, channel_order, channel_signs
from pipeline.sampling import Augmenter, DrawPlan, SampleDraw


def pinned_buffer(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array in page-locked host memory (the batcher's buffers for a GPU): it copies to the GPU
    asynchronously and without a staging copy. The array keeps its tensor, and so the memory, alive."""
    return torch.empty(shape, dtype=torch.float32, pin_memory=True).numpy()


class DeviceCutter:
    """Cuts and rotates the crops of a batch on the device: two gathers and one multiply per tensor.

    Output voxel (c, i0, i1, i2) of sample b reads source channel ``order[c]`` at the coordinates where
    input axis ``perm[a]`` takes ``corner + i_a`` (``corner + S - 1 - i_a`` where the rotation reverses
    output axis a), times the channel's sign: ``pipeline.rotations.rotate_into``, exactly. The spatial
    offset of each output voxel is the sum of three per-axis vectors; one gather takes every channel at
    those offsets (the (B, S^3) offsets broadcast over channels), a second puts the channels in order (in
    NDHWC memory for channels-last), and the sign multiply writes the training dtype. The per-sample
    arguments reach the device in one small non-blocking copy. (One indexing with broadcast indices instead of
    the gathers measured no faster on a CPU, and torch's CUDA indexing writes such indices out in full first.)
    """

    def __init__(self, augmenter: Augmenter, crop_size: int, device: torch.device) -> None:
        self.crop_size, self.device = crop_size, device
        self.steps = torch.arange(crop_size, device=device)
        self.perm = torch.tensor([rot.perm for rot in ROTATIONS], device=device)  # (24, 3)
        self.flip = torch.tensor([[s < 0 for s in rot.signs] for rot in ROTATIONS], device=device)
        self.tables = [
            self._channel_tables(augmenter.in_channels, augmenter.in_vectors),
            self._channel_tables(augmenter.out_channels, augmenter.out_vectors),
        ]

    def _take(self, volume: torch.Tensor, order: torch.Tensor, spatial: torch.Tensor, channels_last: bool) -> Any:
        """Every output voxel of ``volume`` (C, L, L, L), or of a batch (B, C, S, S, S) sample by sample, in the
        (B, C) channel ``order`` at the (B, S^3) ``spatial`` offsets: (B, C, S^3), or (B, S^3, C) for channels-last.
        The gathers read their expanded indices as they are, without writing them out."""
        batch, voxels = spatial.shape
        channels = volume.shape[-4]
        source = volume.reshape(-1, channels, volume.shape[-1] ** 3).expand(batch, -1, -1)  # one volume, every sample
        taken = torch.gather(source, 2, spatial[:, None, :].expand(-1, channels, -1))  # in the source's channel order
        if channels_last:
            return torch.gather(taken.transpose(1, 2), 2, order[:, None, :].expand(-1, voxels, -1))
        return torch.gather(taken, 1, order[:, :, None].expand(-1, -1, voxels))

    def _channel_tables(self, channels: int, groups: VectorGroups) -> tuple[torch.Tensor, torch.Tensor]:
        """Per rotation: the source channel of each output channel, and its sign."""
        order = [channel_order(rot.perm, channels, groups) for rot in ROTATIONS]
        sign = np.stack([channel_signs(rot, channels, groups) for rot in ROTATIONS]).astype(np.float32)
        return torch.tensor(order, device=self.device), torch.from_numpy(sign).to(self.device)

    @staticmethod
    def host_arguments(draws: list[SampleDraw], cut_already: bool) -> torch.Tensor:
        """(B, 4) int64 in host memory: rotation and corner of each sample.

        Crops are cut at each draw's corner from resident volumes, or were cut by the batcher
        (``cut_already``): then sample b is the whole of the source batch's sample b (corner 0).
        """
        host = torch.zeros((len(draws), 4), dtype=torch.int64)
        host[:, 0] = torch.tensor([d.rotation for d in draws])
        if not cut_already:
            host[:, 1:] = torch.tensor([d.corner for d in draws])
        return host

    def arguments(self, draws: list[SampleDraw], cut_already: bool) -> torch.Tensor:
        """``host_arguments`` on the device, in one small non-blocking copy."""
        host = self.host_arguments(draws, cut_already)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def __call__(
        self,
        sources: tuple[torch.Tensor, torch.Tensor],
        args: torch.Tensor,
        dtypes: tuple[torch.dtype, ...],
        channels_last: bool,
    ) -> list[torch.Tensor]:
        """The (inputs, targets) of the batch from ``sources``: volumes (C, L, L, L) or batches (B, C, S, S, S)."""
        size, extent, batch = self.crop_size, sources[0].shape[-1], len(args)
        rotation, corner = args[:, 0], args[:, 1:]
        perm, flip = self.perm[rotation], self.flip[rotation]  # (B, 3): the input axis feeding output axis a
        # Along output axis a: the coordinates on input axis perm[a], times that axis's stride in the volume.
        coords = torch.where(flip[..., None], size - 1 - self.steps, self.steps) + corner.gather(1, perm)[..., None]
        offsets = coords * (extent ** (2 - perm))[..., None]  # (B, 3, S)
        spatial = offsets[:, 0, :, None, None] + offsets[:, 1, None, :, None] + offsets[:, 2, None, None, :]
        spatial = spatial.view(batch, size**3)
        out = []
        for volume, (order_table, sign_table), dtype in zip(sources, self.tables, dtypes, strict=True):
            channels = volume.shape[-4]
            order, sign = order_table[rotation], sign_table[rotation]  # (B, C)
            taken = self._take(volume, order, spatial, channels_last)
            if channels_last:
                result = torch.empty((batch, size, size, size, channels), dtype=dtype, device=volume.device)
                torch.mul(taken.view(result.shape), sign[:, None, None, None, :], out=result)
                out.append(result.permute(0, 4, 1, 2, 3))
            else:
                result = torch.empty((batch, channels, size, size, size), dtype=dtype, device=volume.device)
                torch.mul(taken.view(result.shape), sign[:, :, None, None, None], out=result)
                out.append(result)
        return out


class TorchLoader:
    """Iterates over one epoch of (input, target) NCDHW tensors on ``device`` per ``for`` loop.

    Inputs come in ``dtype``, targets in float32, as from ``DaliLoader``, which this mirrors: either
    ``batcher`` cuts the crops on CPU threads, or ``resident`` volumes on ``device`` are cut here (the
    device storage of both backends); the first epoch starts at ``first_batch``. With
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
            return self.cutter(self.resident, args, (self.dtype, torch.float32), self.channels_last), None
        with torch.cuda.stream(self.cut_stream):  # the arguments' copy too: ordered with the cut, in its memory
            args = self.cutter.arguments(draws, cut_already=False)
            batch = self.cutter(self.resident, args, (self.dtype, torch.float32), self.channels_last)
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
            inp, tar = self._upload(batch)
        else:  # views of the batcher's buffer (in its memory format), no copy: see __iter__
            inp, tar = torch.from_numpy(batch.inp), torch.from_numpy(batch.tar)
        if self.cutter is None:
            return inp.to(self.dtype), tar
        args = self.cutter.arguments(batch.draws, cut_already=True)
        return self.cutter((inp, tar), args, (self.dtype, torch.float32), self.channels_last)

    def _upload(self, batch: CropBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the GPU, copied from the batcher's pinned buffer on the copy stream, with no host sync.

        The training stream waits for the copy on the GPU; the batcher cuts into that buffer again only
        after the copy is done (the guard); the tensors made on the copy stream are marked as used by the
        training stream, so that the allocator does not hand their memory to the next copy too early.
        """
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            inp, tar = (torch.from_numpy(a).to(self.device, non_blocking=True) for a in (batch.inp, batch.tar))
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        compute.wait_event(copied)
        for tensor in (inp, tar):
            tensor.record_stream(compute)
        self.batcher.guard(batch, copied)
        return inp, tar

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
