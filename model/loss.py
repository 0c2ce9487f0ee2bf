"""The one loss of the project: L1 (the reference's), plus optional terms, all off by default: ``lambda_rho`` (gas
density in original space), ``lambda_T`` and ``lambda_hot`` (the temperature in physical units, and weighted by
it), ``lambda_v`` and ``lambda_div`` (the gas velocity, and its divergence) and ``lambda_pk`` (the crops' power
spectra). docs/training.md (Loss) says what each computes and why.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from pipeline.layout import GAS_DENSITY, TEMPERATURE, density, temperature

POWER_FLOOR = 1e-12  # a truth without fluctuations (a constant crop): its total power is taken as this


@functools.cache
def _shells(size: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Shell index (nearest integer |k|, in units of the crop's fundamental mode) of each rfft mode of a crop, the
    modes per shell, and the number of shells (1 to half the smallest side; 0 collects k = 0 and the corners)."""
    freqs = [torch.fft.fftfreq(n, d=1.0 / n) for n in size[:-1]] + [torch.fft.rfftfreq(size[-1], d=1.0 / size[-1])]
    grid = torch.meshgrid(*freqs, indexing="ij")
    k = torch.sqrt(sum(f**2 for f in grid)).round().long()
    shells = min(size) // 2
    index = torch.where(k <= shells, k, 0).flatten().to(device)
    counts = torch.bincount(index, minlength=shells + 1).to(torch.float32)
    return index, counts, shells


def crop_power(x: torch.Tensor) -> torch.Tensor:
    """Power per channel and shell of |k| (C, shells) of a batch of crops (B, C, D, H, W), averaged over the batch
    and the shell's modes; shells 1 to half the crop's side (k = 0, the mean, is left out)."""
    index, counts, shells = _shells(tuple(x.shape[2:]), x.device)
    modes = torch.fft.rfftn(x, dim=(2, 3, 4), norm="ortho").abs().square().mean(0).flatten(1)
    power = torch.zeros(x.shape[1], shells + 1, device=x.device).index_add_(1, index, modes)
    return (power / counts)[:, 1:]


def divergence(v: torch.Tensor) -> torch.Tensor:
    """div v of a batch of velocity crops (N, 3, S, S, S) by central differences, on the crops' interior voxels."""
    return (
        (v[:, 0, 2:, 1:-1, 1:-1] - v[:, 0, :-2, 1:-1, 1:-1])
        + (v[:, 1, 1:-1, 2:, 1:-1] - v[:, 1, 1:-1, :-2, 1:-1])
        + (v[:, 2, 1:-1, 1:-1, 2:] - v[:, 2, 1:-1, 1:-1, :-2])
    ) / 2


class MissingInput(ValueError):
    """A term asked for without what it needs (``what``): ``needs`` names the setting that gives it."""

    def __init__(self, what: str, *, needs: str) -> None:
        super().__init__(f"{what} ({needs})")
        self.what, self.needs = what, needs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loss:
    """Mean absolute error over all channels, plus the optional terms above. Computed in float32 whatever the
    training precision: exp(14 x) overflows float16 above x = 0.79, and so do powers of a crop."""

    lambda_rho: float = 0.0
    lambda_pk: float = 0.0
    lambda_T: float = 0.0
    lambda_hot: float = 0.0
    lambda_v: float = 0.0
    lambda_div: float = 0.0
    temperature_log_range: float | None = None  # needed by lambda_T and lambda_hot
    velocity: tuple[int, ...] | None = (1, 2, 3)  # the gas velocity's x, y and z channels, for lambda_v, lambda_div

    def __post_init__(self) -> None:
        """Each term's prerequisites, the only place they are checked (the trainer says which file lacks them)."""
        if (self.lambda_T or self.lambda_hot) and not self.temperature_log_range:
            asked = " and ".join(name for name in ("lambda_T", "lambda_hot") if getattr(self, name))
            raise MissingInput(f"{asked} needs the temperature's normalization", needs="temperature_log_range")
        if (self.lambda_v or self.lambda_div) and not self.velocity:
            raise MissingInput("lambda_v and lambda_div need the gas velocity's channels", needs="target_vectors")

    @classmethod
    def weights(cls) -> tuple[str, ...]:
        """The names of the terms' weights: every ``lambda_*`` field, each a config key of the same name."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name.startswith("lambda_"))

    def __call__(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred, target = pred.float(), target.float()
        loss = (pred - target).abs().mean()
        if self.lambda_rho:
            rho_pred, rho_target = density(pred[:, GAS_DENSITY]), density(target[:, GAS_DENSITY])
            loss = loss + self.lambda_rho * (rho_pred - rho_target).abs().mean()
        if self.lambda_T or self.lambda_hot:
            t_pred, t_true = (temperature(x[:, TEMPERATURE], self.temperature_log_range) for x in (pred, target))
            mean_t = t_true.mean()
            if self.lambda_T:
                loss = loss + self.lambda_T * (t_pred - t_true).abs().mean() / mean_t
            if self.lambda_hot:
                error = (pred[:, TEMPERATURE] - target[:, TEMPERATURE]).abs()
                loss = loss + self.lambda_hot * (t_true / mean_t * error).mean()
        if self.lambda_v or self.lambda_div:
            v_pred, v_true = (x[:, list(self.velocity)] for x in (pred, target))
            if self.lambda_v:
                loss = loss + self.lambda_v * (v_pred - v_true).abs().mean()
            if self.lambda_div:
                loss = loss + self.lambda_div * (divergence(v_pred) - divergence(v_true)).abs().mean()
        if self.lambda_pk:
            p_pred, p_true = crop_power(pred), crop_power(target)
            total = p_true.sum(dim=1).clamp_min(POWER_FLOOR)
            loss = loss + self.lambda_pk * ((p_pred - p_true).abs().sum(dim=1) / total).mean()
        return loss
