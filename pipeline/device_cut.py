"""Cutting and rotating a batch of crops on the training device, with torch: one implementation for the device
storage of both backends (DALI calls it inside its graph, the torch backend on its cut stream) and for batches the CPU
batcher cut and the torch backend copied over. For the same draws the samples equal the numpy reference's
(``pipeline.rotations.rotate_into``; tested for all 24 rotations and both layouts).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipeline.rotations import ROTATIONS, VectorGroups, channel_order, channel_signs
from pipeline.sampling import Augmenter, SampleDraw


class DeviceCutter:
    """Cuts and rotates the crops of a batch on the device: two gathers and one multiply per tensor.

    One gather takes every channel at each output voxel's source offset (the sum of three per-axis vectors), a second
    puts the channels in the sample's order (NDHWC memory for channels-last), and the sign multiply writes the training
    dtype: ``pipeline.rotations.rotate_into``, exactly. docs/data.md (Backends) tells the routes not taken.
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

    def _take(self, volume: torch.Tensor, order: torch.Tensor, spatial: torch.Tensor, *, channels_last: bool) -> Any:
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
    def host_arguments(draws: list[SampleDraw], *, cut_already: bool) -> torch.Tensor:
        """(B, 4) int64 in host memory: rotation and corner of each sample.

        Crops are cut at each draw's corner from resident volumes, or were cut by the batcher
        (``cut_already``): then sample b is the whole of the source batch's sample b (corner 0).
        """
        host = torch.zeros((len(draws), 4), dtype=torch.int64)
        host[:, 0] = torch.tensor([d.rotation for d in draws])
        if not cut_already:
            host[:, 1:] = torch.tensor([d.corner for d in draws])
        return host

    def arguments(self, draws: list[SampleDraw], *, cut_already: bool) -> torch.Tensor:
        """``host_arguments`` on the device, in one small non-blocking copy."""
        host = self.host_arguments(draws, cut_already=cut_already)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def __call__(
        self,
        sources: tuple[torch.Tensor, torch.Tensor],
        args: torch.Tensor,
        dtypes: tuple[torch.dtype, ...],
        *,
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
            taken = self._take(volume, order, spatial, channels_last=channels_last)
            if channels_last:
                result = torch.empty((batch, size, size, size, channels), dtype=dtype, device=volume.device)
                torch.mul(taken.view(result.shape), sign[:, None, None, None, :], out=result)
                out.append(result.permute(0, 4, 1, 2, 3))
            else:
                result = torch.empty((batch, channels, size, size, size), dtype=dtype, device=volume.device)
                torch.mul(taken.view(result.shape), sign[:, :, None, None, None], out=result)
                out.append(result)
        return out
