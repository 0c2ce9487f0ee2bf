"""The torch backend: the DALI pipeline's semantics with torch ops, for machines without DALI.

Crops come from the same CPU batcher (or are sliced from volumes resident on the device); the
rotation, where the device does it, is a permute (a view), a flip and a channel gather, then the
vector components' signs, on the training device. For the same draws the samples equal the DALI
backend's and the numpy reference's (tested).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pipeline.crops import CropBatcher
from pipeline.rotations import ROTATIONS, Rotation, VectorGroups, channel_order, channel_signs
from pipeline.sampling import Augmenter, DrawPlan, SampleDraw


def rotate_tensor(x: torch.Tensor, rot: Rotation, vectors: VectorGroups) -> torch.Tensor:
    """``x`` (C, D, H, W) rotated as ``pipeline.rotations.rotate_into`` does, as a new tensor."""
    y = x.permute(0, *(1 + p for p in rot.perm))
    flips = [1 + a for a in range(3) if rot.signs[a] < 0]
    if flips:
        y = y.flip(flips)
    order = channel_order(rot.perm, x.shape[0], vectors)
    y = y[list(order)] if order != tuple(range(x.shape[0])) else y.contiguous()
    negative = [c for c, s in enumerate(channel_signs(rot, x.shape[0], vectors)) if s < 0]
    if negative:
        y[negative] = -y[negative]
    return y


class TorchLoader:
    """Iterates over one epoch of (input, target) NCDHW tensors on ``device`` per ``for`` loop.

    Inputs come in ``dtype``, targets in float32, as from ``DaliLoader``, which this mirrors: either
    ``batcher`` cuts the crops on CPU threads, or ``resident`` volumes on ``device`` are sliced here;
    the first epoch starts at ``first_batch``.
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
        self.plan, self.augmenter, self.device, self.dtype = plan, augmenter, device, dtype
        self.rotate_on_device = rotate_on_device and plan.rotate
        self.batcher, self.resident = batcher, resident
        self.epoch, self.next_batch = first_epoch, first_batch
        self.channels_last = channels_last

    def __len__(self) -> int:
        return self.plan.num_batches

    def _rotate(self, inp: torch.Tensor, tar: torch.Tensor, draw: SampleDraw) -> tuple[torch.Tensor, torch.Tensor]:
        rot = ROTATIONS[draw.rotation]
        return rotate_tensor(inp, rot, self.augmenter.in_vectors), rotate_tensor(tar, rot, self.augmenter.out_vectors)

    def _batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batcher is not None:
            batch = self.batcher.get(self.epoch, index)
            # The batcher's buffer is reused later: copy it, to the device (or into a new CPU tensor), keeping its
            # memory format (channels-last when the batcher cut it so).
            inp = torch.from_numpy(batch.inp).to(self.device, copy=True)
            tar = torch.from_numpy(batch.tar).to(self.device, copy=True)
            draws = batch.draws
            if not self.rotate_on_device:
                return inp.to(self.dtype), tar
            pairs = [self._rotate(inp[j], tar[j], d) for j, d in enumerate(draws)]
        else:
            nbody, hydro = self.resident
            size = self.plan.crop_size
            pairs = []
            for draw in self.plan.batch_draws(self.epoch, index):
                x, y, z = draw.corner
                window = (slice(None), slice(x, x + size), slice(y, y + size), slice(z, z + size))
                if self.rotate_on_device:
                    pairs.append(self._rotate(nbody[window], hydro[window], draw))
                else:
                    pairs.append((nbody[window], hydro[window]))
        inp = torch.stack([p[0] for p in pairs]).to(self.dtype)
        tar = torch.stack([p[1] for p in pairs]).float()
        if self.channels_last:
            inp = inp.contiguous(memory_format=torch.channels_last_3d)
            tar = tar.contiguous(memory_format=torch.channels_last_3d)
        return inp, tar

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.next_batch, self.plan.num_batches):
            yield self._batch(index)
        self.epoch, self.next_batch = self.epoch + 1, 0
