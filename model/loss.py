"""The one loss of the project: L1 (the reference's), plus optional terms, all off by default: ``lambda_rho`` (gas
density in original space), ``lambda_T`` and ``lambda_hot`` (the temperature in physical units, and weighted by
it), ``lambda_v`` and ``lambda_div`` (the gas velocity, and its divergence), ``lambda_pk`` (the crops' power
spectra) and ``lambda_T_power`` (the temperature's fluctuation power at the crops' largest scales).
docs/training.md (Loss) says what each computes and why.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from pipeline.layout import GAS_DENSITY, TEMPERATURE, density, temperature

POWER_FLOOR = 1e-12  # a truth without fluctuations (a constant crop): its total power is taken as this
# The terms that need the temperature in kelvin, so the temperature's normalization.
_NEED_TEMPERATURE = ("lambda_T", "lambda_hot", "lambda_T_power", "lambda_T_mse")


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


@functools.cache
def _taper(size: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """A 3D Hann window over a crop: it takes the jump between a crop's opposite faces, which its FFT sees as a
    periodic field's, out of the power at every scale."""
    axes = [torch.sin(torch.pi * (torch.arange(n) + 0.5) / n).square() for n in size]
    return (axes[0][:, None, None] * axes[1][None, :, None] * axes[2][None, None, :]).to(device)


def temperature_power_gap(t_pred: torch.Tensor, t_true: torch.Tensor) -> torch.Tensor:
    """Mean over the crops' shells 1 to a quarter of their Nyquist of |log(P_pred(k) / P_true(k))|, the batch's
    power of two fields (B, D, H, W) per shell, each crop's mean taken out and the crop tapered to its faces: 0 when
    the prediction has the true power at those scales, whatever its phases, and the same for too little power as for
    too much by the same factor. Those shells are where a crop's truth has its fluctuations and the science target
    judges them (k 4-16 of a 128^3 box in 32^3 crops: a crop sees no larger scale)."""
    fields = torch.stack((t_pred, t_true), dim=1)
    fields = (fields - fields.mean(dim=(2, 3, 4), keepdim=True)) * _taper(tuple(fields.shape[2:]), fields.device)
    power = crop_power(fields)
    shells = max(1, min(t_true.shape[1:]) // 8)
    p_pred, p_true = power[:, :shells].clamp_min(POWER_FLOOR)
    return (p_pred.log() - p_true.log()).abs().mean()


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
    lambda_T_power: float = 0.0
    lambda_T_mse: float = 0.0
    lambda_v: float = 0.0
    lambda_div: float = 0.0
    temperature_log_range: float | None = None  # needed by the terms of _NEED_TEMPERATURE
    velocity: tuple[int, ...] | None = (1, 2, 3)  # the gas velocity's x, y and z channels, for lambda_v, lambda_div

    def __post_init__(self) -> None:
        """Each term's prerequisites, the only place they are checked (the trainer says which file lacks them)."""
        if any(getattr(self, name) for name in _NEED_TEMPERATURE) and not self.temperature_log_range:
            asked = " and ".join(name for name in _NEED_TEMPERATURE if getattr(self, name))
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
        if any(getattr(self, name) for name in _NEED_TEMPERATURE):
            t_pred, t_true = (temperature(x[:, TEMPERATURE], self.temperature_log_range) for x in (pred, target))
            mean_t = t_true.mean()
            if self.lambda_T:
                loss = loss + self.lambda_T * (t_pred - t_true).abs().mean() / mean_t
            if self.lambda_hot:
                error = (pred[:, TEMPERATURE] - target[:, TEMPERATURE]).abs()
                loss = loss + self.lambda_hot * (t_true / mean_t * error).mean()
            if self.lambda_T_mse:
                loss = loss + self.lambda_T_mse * (t_pred - t_true).square().mean() / mean_t.square()
            if self.lambda_T_power:
                loss = loss + self.lambda_T_power * temperature_power_gap(t_pred / mean_t, t_true / mean_t)
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
