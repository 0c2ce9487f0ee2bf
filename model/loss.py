"""The one loss of the project: L1, plus optionally L1 on gas density in original space."""

from __future__ import annotations

import torch

from pipeline.layout import LOG_DENSITY_SCALE


def unet_loss(pred: torch.Tensor, target: torch.Tensor, lambda_rho: float = 0.0) -> torch.Tensor:
    """Mean absolute error over all channels, plus ``lambda_rho`` times that of exp(14 x) on channel 0.

    Channel 0 holds log(rho) / 14; the second term compares densities themselves, weighting dense
    regions. It is computed in float32 whatever the training precision: exp(14 x) overflows float16
    above x = 0.79.
    """
    pred, target = pred.float(), target.float()
    loss = (pred - target).abs().mean()
    if lambda_rho:
        rho_pred = torch.exp(LOG_DENSITY_SCALE * pred[:, 0])
        rho_target = torch.exp(LOG_DENSITY_SCALE * target[:, 0])
        loss = loss + lambda_rho * (rho_pred - rho_target).abs().mean()
    return loss
