"""The reference 3D U-Net (NERSC ml-pm-training-2022), with width and depth knobs for small runs.

Each level halves the volume with Conv3d(k=4, s=2, p=1) + LeakyReLU; the way back doubles it with
ConvTranspose3d(k=4, s=2, p=1) + ReLU and concatenates the skip of the same level; a last
ConvTranspose3d maps to the output channels and tanh bounds them to (-1, 1) like the targets.
Channels per level are ``min(width * 2^i, 8 * width)``: with the defaults (width 64, depth 6) that is
64-128-256-512-512-512, the reference's ``full_scale`` network of 117.0 M parameters; depth 5 is its
``full_scale: False``. Crops must be a multiple of 2^depth voxels on a side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def level_channels(width: int, depth: int) -> list[int]:
    return [min(width * 2**i, 8 * width) for i in range(depth)]


@dataclass(frozen=True, kw_only=True)
class UNetSpec:
    """The network's architecture: all it takes to build one (``spec.build()``)."""

    in_channels: int
    out_channels: int
    width: int
    depth: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> UNetSpec:
        """From a run's config (its keys are the reference's: N_in_channels, unet_width...)."""
        return cls(
            in_channels=config["N_in_channels"],
            out_channels=config["N_out_channels"],
            width=config["unet_width"],
            depth=config["unet_depth"],
        )

    def build(self) -> UNet:
        """The network, with PyTorch's initialization."""
        return UNet(self.in_channels, self.out_channels, self.width, depth=self.depth)


class UNet(nn.Module):
    def __init__(self, in_channels: int = 4, out_channels: int = 5, width: int = 64, *, depth: int = 6) -> None:
        super().__init__()
        if depth < 2:
            raise ValueError(f"U-Net depth must be at least 2, got {depth}")
        channels = level_channels(width, depth)
        self.depth = depth
        self.down = nn.ModuleList()
        previous = in_channels
        for c in channels:
            self.down.append(nn.Sequential(nn.Conv3d(previous, c, 4, stride=2, padding=1), nn.LeakyReLU(inplace=True)))
            previous = c
        # up[j] undoes down level (depth - 1 - j); its input is the level below, concatenated with that
        # level's skip, except at the bottom where there is nothing to concatenate yet.
        self.up = nn.ModuleList()
        for level in reversed(range(1, depth)):
            c_in = channels[level] if level == depth - 1 else 2 * channels[level]
            self.up.append(
                nn.Sequential(
                    nn.ConvTranspose3d(c_in, channels[level - 1], 4, stride=2, padding=1), nn.ReLU(inplace=True)
                )
            )
        self.last = nn.ConvTranspose3d(2 * channels[0], out_channels, 4, stride=2, padding=1)
        self.last_padded_to = out_channels

    def pad_last_layer(self, multiple: int) -> None:
        """Compute the last layer with its output channels padded with zero filters to a multiple of ``multiple``
        (tensor cores want channel counts that are multiples of 8; the last layer has 5), and drop the padding from
        its output: the same values, and the same parameters and checkpoints, as without it."""
        out = self.last.out_channels
        self.last_padded_to = -(-out // multiple) * multiple

    def _last(self, x: torch.Tensor) -> torch.Tensor:
        layer, extra = self.last, self.last_padded_to - self.last.out_channels
        if not extra:
            return layer(x)
        weight = F.pad(layer.weight, (0, 0, 0, 0, 0, 0, 0, extra))  # (in, out, k, k, k): zero filters appended
        bias = F.pad(layer.bias, (0, extra))
        padded = F.conv_transpose3d(x, weight, bias, stride=layer.stride, padding=layer.padding)
        return padded[:, : layer.out_channels]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        skips.pop()  # the bottom level feeds the first up-convolution directly
        for block in self.up:
            x = torch.cat([block(x), skips.pop()], dim=1)
        return torch.tanh(self._last(x))

    def init_weights(self, conv_scale: float = 0.02, conv_bias: float | None = 0.0) -> None:
        """The reference's init: conv weights ~ N(0, conv_scale), biases set to conv_bias (left alone if None)."""
        for m in self.modules():
            if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):
                nn.init.normal_(m.weight, 0.0, conv_scale)
                if conv_bias is not None:
                    nn.init.constant_(m.bias, conv_bias)
