"""DALI pipelines: crops from an external source, rotated on the training device.

The graph reads like the recipe: take a crop, move it to the device, rotate it (inputs and targets
alike, vector channels turned with the volume), cast the input to the dtype the engine trains in.
Targets stay float32, the precision of the loss: float16 would round them by up to 2.4e-4, a
visible share of a converged L1 of about 5e-3. The same graph runs on the CPU (``device_id=None``)
and on a GPU; only where the data lives differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator

from pipeline.rotations import AXIS_PERMUTATIONS, VectorGroups, channel_order
from pipeline.sampling import Augmenter, SampleDraw
from pipeline.volumes import VolumePair

DrawFn = Callable[[int, int], SampleDraw]  # (epoch, index in epoch) -> draw

# DALI has no bfloat16: such batches leave the pipeline as float32 and are cast by torch.
_DALI_DTYPES = {torch.float32: types.FLOAT, torch.float16: types.FLOAT16, torch.bfloat16: types.FLOAT}


class CropSource:
    """Per-sample callback of ``fn.external_source``: the crop (and rotation arguments) of one sample.

    An epoch is ``num_samples`` samples; asking for more raises StopIteration, which ends DALI's
    epoch. Epoch numbers count from ``first_epoch`` so that a resumed run replays the same draws.
    """

    def __init__(
        self,
        volumes: VolumePair,
        crop_size: int,
        num_samples: int,
        draw: DrawFn,
        augmenter: Augmenter | None,
        first_epoch: int = 0,
    ) -> None:
        self.volumes = volumes
        self.crop_size = crop_size
        self.num_samples = num_samples
        self.draw = draw
        self.augmenter = augmenter
        self.first_epoch = first_epoch

    @property
    def num_outputs(self) -> int:
        return 2 if self.augmenter is None else 6

    def __call__(self, info) -> tuple[np.ndarray, ...]:  # info: nvidia.dali.types.SampleInfo
        if info.idx_in_epoch >= self.num_samples:
            raise StopIteration
        draw = self.draw(self.first_epoch + info.epoch_idx, info.idx_in_epoch)
        inp, tar = self.volumes.crop(draw.corner, self.crop_size)
        if self.augmenter is None:
            return inp, tar
        args_in, args_out = self.augmenter.args(draw)
        return inp, tar, np.int32(args_in.perm_index), args_in.flips, args_in.sign, args_out.sign


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
    """Rotate a CDHW DataNode as ``pipeline.rotations.rotate_volume`` does, exactly.

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
def _graph(source: CropSource, on_gpu: bool, dtype: types.DALIDataType):
    outputs = fn.external_source(
        source, num_outputs=source.num_outputs, batch=False, layout=["CDHW", "CDHW"] + [""] * (source.num_outputs - 2)
    )
    if on_gpu:
        outputs = [node.gpu() for node in outputs[:2]] + list(outputs[2:])
    inp, tar = outputs[:2]
    if source.augmenter is not None:
        perm_index, flips, sign_in, sign_out = outputs[2:]
        if on_gpu:
            sign_in, sign_out = sign_in.gpu(), sign_out.gpu()
        aug = source.augmenter
        inp = rotate(inp, perm_index, flips, sign_in, aug.in_channels, aug.in_vectors)
        tar = rotate(tar, perm_index, flips, sign_out, aug.out_channels, aug.out_vectors)
    if dtype != types.FLOAT:
        inp = fn.cast(inp, dtype=dtype)
    return inp, tar


class DaliLoader:
    """Iterates over one epoch of (input, target) NCDHW torch tensors per ``for`` loop.

    Inputs come in ``dtype`` (the engine's), targets in float32.
    """

    def __init__(
        self,
        source: CropSource,
        batch_size: int,
        device_id: int | None,
        dtype: torch.dtype,
        num_threads: int,
    ) -> None:
        if source.num_samples % batch_size:
            raise ValueError(f"{source.num_samples} samples per epoch is not a multiple of the batch size {batch_size}")
        self.batches_per_epoch = source.num_samples // batch_size
        self.dtype = dtype
        pipe = _graph(
            source=source,
            on_gpu=device_id is not None,
            dtype=_DALI_DTYPES[dtype],
            batch_size=batch_size,
            num_threads=num_threads,
            device_id=device_id,
            seed=0,  # the graph draws nothing itself; all randomness comes from the source
        )
        # The epoch ends when the source raises StopIteration; auto_reset starts the next one.
        self._iterator = DALIGenericIterator([pipe], ["inp", "tar"], auto_reset=True)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self._iterator:
            inp, tar = batch[0]["inp"], batch[0]["tar"]
            if inp.dtype != self.dtype:  # bfloat16 only: one cast kernel per batch
                inp = inp.to(self.dtype)
            yield inp, tar
