"""DALI pipelines: batches from an external source, rotated on the training device.

The graph reads like the recipe: take the crops the CPU batcher cut, rotate them unless it already did
(inputs and targets alike, vector channels turned with the volume), cast the input to the dtype the
engine trains in. Targets stay float32, the precision of the loss: float16 would round them by up to
2.4e-4, a visible share of a converged L1 of about 5e-3. The same graph runs on the CPU
(``device_id=None``) and on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator

from pipeline.crops import CropBatcher
from pipeline.rotations import AXIS_PERMUTATIONS, VectorGroups, channel_order
from pipeline.sampling import Augmenter, DrawPlan, SampleDraw

# DALI has no bfloat16: such batches leave the pipeline as float32 and are cast by torch.
_DALI_DTYPES = {torch.float32: types.FLOAT, torch.float16: types.FLOAT16, torch.bfloat16: types.FLOAT}


def rotation_arrays(draws: list[SampleDraw], augmenter: Augmenter) -> tuple[np.ndarray, ...]:
    """Per-sample rotation arguments of a batch: axis-order index, flips, input and target signs."""
    args = [augmenter.args(d) for d in draws]
    return (
        np.array([a.perm_index for a, _ in args], dtype=np.int32),
        np.stack([a.flips for a, _ in args]),
        np.stack([a.sign for a, _ in args]),
        np.stack([b.sign for _, b in args]),
    )


def _position(info: Any, first_epoch: int, first_batch: int, num_batches: int) -> tuple[int, int]:
    """(epoch, batch) for DALI's (epoch_idx, iteration); the first epoch starts at ``first_batch``."""
    batch = info.iteration + (first_batch if info.epoch_idx == 0 else 0)
    if batch >= num_batches:
        raise StopIteration
    return first_epoch + info.epoch_idx, batch


class _BatcherFeed:
    """External-source callback: the batcher's batch for DALI's (epoch, iteration), and the arguments
    of its rotations where the graph rotates (``rotate_here``)."""

    def __init__(self, batcher: CropBatcher, first_epoch: int, first_batch: int, rotate_here: bool) -> None:
        self.batcher, self.first_epoch, self.first_batch = batcher, first_epoch, first_batch
        self.rotate_here = rotate_here

    def __call__(self, info: Any) -> tuple[np.ndarray, ...]:  # info: nvidia.dali.types.BatchInfo
        epoch, index = _position(info, self.first_epoch, self.first_batch, self.batcher.plan.num_batches)
        batch = self.batcher.get(epoch, index)
        inp, tar, _ = batch.contiguous()
        if not self.rotate_here:
            return inp, tar
        return (inp, tar, *rotation_arrays(batch.draws, self.batcher.augmenter))


def _gather_channels(x, order: tuple[int, ...]):
    """Reorder the channels of a CDHW DataNode (a static order), copying runs of consecutive channels at once."""
    if order == tuple(range(len(order))):
        return x
    runs: list[list[int]] = []
    for c in order:
        if runs and c == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([c, c + 1])
    return fn.cat(*(x[start:stop] for start, stop in runs), axis=0)


def rotate(x, perm_index, flips, sign, num_channels: int, vectors: VectorGroups):
    """Rotate a CDHW DataNode as ``pipeline.rotations.rotate_into`` does, exactly.

    ``fn.transpose`` takes no per-sample permutation, so each of the six axis orders is a branch
    (DALI conditionals split the batch by ``perm_index``); its channel reorder is static within the
    branch. Flips and the sign of the vector components are per-sample arguments.
    """
    y = x
    for i, perm in enumerate(AXIS_PERMUTATIONS):
        if i == 0:
            continue  # the identity order
        if perm_index == i:
            y = fn.transpose(x, perm=[0, *(1 + p for p in perm)], transpose_layout=False)
            y = _gather_channels(y, channel_order(perm, num_channels, vectors))
    y = fn.flip(y, depthwise=flips[0], vertical=flips[1], horizontal=flips[2])
    return y * sign


@pipeline_def(enable_conditionals=True)
def _graph(feed: _BatcherFeed, augmenter: Augmenter, rotate_here: bool, on_gpu: bool, dtype, channels_last: bool):
    num_outputs = 6 if rotate_here else 2
    layout = "DHWC" if feed.batcher.channels_last else "CDHW"  # the batcher cut channels-last already
    inp, tar, *args = fn.external_source(
        feed, num_outputs=num_outputs, batch=True, batch_info=True, no_copy=True,
        layout=[layout, layout] + [""] * (num_outputs - 2),
    )  # fmt: skip
    if on_gpu:
        inp, tar = inp.gpu(), tar.gpu()
    if rotate_here:
        perm_index, flips, sign_in, sign_out = args
        if on_gpu:
            sign_in, sign_out = sign_in.gpu(), sign_out.gpu()
        inp = rotate(inp, perm_index, flips, sign_in, augmenter.in_channels, augmenter.in_vectors)
        tar = rotate(tar, perm_index, flips, sign_out, augmenter.out_channels, augmenter.out_vectors)
    if channels_last and layout == "CDHW":  # on the device: one transpose to NDHWC, the model's memory format
        inp = fn.transpose(inp, perm=[1, 2, 3, 0], transpose_layout=False)
        tar = fn.transpose(tar, perm=[1, 2, 3, 0], transpose_layout=False)
    if dtype != types.FLOAT:
        inp = fn.cast(inp, dtype=dtype)
    return inp, tar


class DaliLoader:
    """Iterates over one epoch of (input, target) NCDHW torch tensors per ``for`` loop.

    Inputs come in ``dtype`` (the engine's), targets in float32. ``batcher`` cuts the crops on CPU
    threads; with ``rotate_on_device`` the graph rotates them, otherwise the batcher must have
    (``rotate_here``). The first epoch (``first_epoch``) starts at batch ``first_batch``: a run resumed
    part-way through it. With ``channels_last`` the batches are NDHWC in memory (torch's
    channels_last_3d), as the model then wants. (Volumes resident on a GPU are cut by the torch
    backend's gather: DALI's GPU external source would copy a batch that lists the same volume per sample.)
    """

    def __init__(
        self,
        *,
        plan: DrawPlan,
        augmenter: Augmenter,
        device_id: int | None,
        dtype: torch.dtype,
        rotate_on_device: bool,
        batcher: CropBatcher,
        first_epoch: int = 0,
        first_batch: int = 0,
        channels_last: bool = False,
    ) -> None:
        if batcher.rotate_here == rotate_on_device and plan.rotate:
            raise ValueError("exactly one of the batcher and the device must rotate")
        self.channels_last = channels_last
        self.batcher = batcher
        self.num_batches = plan.num_batches
        self.dtype = dtype
        rotate_here = rotate_on_device and plan.rotate
        pipe = _graph(
            feed=_BatcherFeed(batcher, first_epoch, first_batch, rotate_here),
            augmenter=augmenter,
            rotate_here=rotate_here,
            on_gpu=device_id is not None,
            dtype=_DALI_DTYPES[dtype],
            channels_last=channels_last,
            batch_size=plan.batch_size,
            num_threads=1,  # the graph's CPU work is bookkeeping: crops are cut by the batcher
            device_id=device_id,
            prefetch_queue_depth=1,  # the batcher already works ahead
            seed=0,  # the graph draws nothing itself: all randomness comes from the plan
        )
        # The epoch ends when the feed raises StopIteration; auto_reset starts the next one.
        self._iterator = DALIGenericIterator([pipe], ["inp", "tar"], auto_reset=True)

    def close(self) -> None:
        """Stop the batcher's threads and the work they had started ahead."""
        self.batcher.close()

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self._iterator:
            inp, tar = batch[0]["inp"], batch[0]["tar"]
            if self.channels_last:  # NDHWC in memory, seen as NCDHW: channels_last_3d strides, no copy
                inp, tar = inp.permute(0, 4, 1, 2, 3), tar.permute(0, 4, 1, 2, 3)
            if inp.dtype != self.dtype:  # bfloat16 only: one cast kernel per batch (keeps the memory format)
                inp = inp.to(self.dtype)
            yield inp, tar
