import numpy as np
import pytest
import torch

from model import Loss, UNet
from model.loss import crop_power, divergence
from pipeline.layout import LOG_DENSITY_SCALE


def test_reference_size_and_shape():
    with torch.device("meta"):  # 117 M parameters and a 64^3 forward, without the memory or the FLOPs
        net = UNet()
        out = net(torch.empty(2, 4, 64, 64, 64))
    assert sum(p.numel() for p in net.parameters()) == 116_977_029  # "117.0 M"
    assert out.shape == (2, 5, 64, 64, 64)
    assert [m[0].out_channels for m in net.down] == [64, 128, 256, 512, 512, 512]
    assert [m[0].in_channels for m in net.up] == [512, 1024, 1024, 512, 256]


def test_reference_half_scale_has_five_levels():
    with torch.device("meta"):
        net = UNet(depth=5)
    assert [m[0].out_channels for m in net.down] == [64, 128, 256, 512, 512]
    assert net.up[0][0].in_channels == 512


def test_small_network_runs_and_is_bounded():
    torch.manual_seed(0)
    net = UNet(width=4, depth=3)
    net.init_weights(conv_scale=0.05, conv_bias=0.0)
    out = net(torch.randn(2, 4, 16, 16, 16))
    assert out.shape == (2, 5, 16, 16, 16)
    assert out.abs().max() < 1 and out.std() > 0.05


def test_reference_init():
    torch.manual_seed(0)
    net = UNet(width=8, depth=3)
    net.init_weights(conv_scale=0.02, conv_bias=0.0)
    weights = torch.cat(
        [m.weight.flatten() for m in net.modules() if isinstance(m, (torch.nn.Conv3d, torch.nn.ConvTranspose3d))]
    )
    assert weights.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(torch.all(m.bias == 0) for m in net.modules() if hasattr(m, "bias") and m.bias is not None)


def test_depth_must_be_at_least_two():
    with pytest.raises(ValueError, match="at least 2"):
        UNet(depth=1)


def test_loss_is_l1_plus_density_term():
    torch.manual_seed(0)
    pred, target = torch.rand(2, 5, 4, 4, 4) - 0.5, torch.rand(2, 5, 4, 4, 4) - 0.5
    l1 = (pred - target).abs().mean()
    assert Loss()(pred, target).item() == pytest.approx(l1.item())
    rho = (torch.exp(LOG_DENSITY_SCALE * pred[:, 0]) - torch.exp(LOG_DENSITY_SCALE * target[:, 0])).abs().mean()
    assert Loss(lambda_rho=0.3)(pred, target).item() == pytest.approx((l1 + 0.3 * rho).item(), rel=1e-6)


def test_temperature_terms_are_l1_and_l2_in_physical_units_and_l1_weighted_by_the_temperature():
    """Checked against float64 numpy: channel 4 holds log10(T / T0) / range."""
    rng = np.random.default_rng(1)
    pred, target = rng.uniform(-0.5, 1.0, (2, 2, 5, 4, 4, 4))
    t_pred, t_true = 10.0 ** (3.0 * pred[:, 4]), 10.0 ** (3.0 * target[:, 4])
    l1 = np.abs(pred - target).mean()
    physical = np.abs(t_pred - t_true).mean() / t_true.mean()
    weighted = (t_true / t_true.mean() * np.abs(pred[:, 4] - target[:, 4])).mean()
    squared = np.square(t_pred - t_true).mean() / t_true.mean() ** 2
    tensors = torch.from_numpy(pred).float(), torch.from_numpy(target).float()
    assert Loss(lambda_T=0.5, temperature_log_range=3.0)(*tensors).item() == pytest.approx(l1 + 0.5 * physical, 1e-5)
    assert Loss(lambda_hot=0.2, temperature_log_range=3.0)(*tensors).item() == pytest.approx(l1 + 0.2 * weighted, 1e-5)
    assert Loss(lambda_T_mse=0.3, temperature_log_range=3.0)(*tensors).item() == pytest.approx(l1 + 0.3 * squared, 1e-5)
    with pytest.raises(ValueError, match="temperature_log_range"):
        Loss(lambda_T=0.5)


@pytest.mark.parametrize("term", ["lambda_T", "lambda_hot"])
def test_temperature_terms_pull_hardest_where_the_gas_is_hot(term):
    """The same error of 0.1 in normalized log T, in a voxel at T0 and one at 100 T0: the normalized L1 pulls both
    alike, the temperature terms pull the hot one 100 times harder (1 + the term's share, for the L1 part)."""
    target = torch.zeros(1, 5, 2, 1, 1)
    target[0, 4, 1] = 2 / 3  # 10^(3 x 2/3) = 100 T0
    pred = (target + 0.1).requires_grad_()
    loss = Loss(temperature_log_range=3.0, **{term: 1.0})
    (loss(pred, target) - Loss()(pred, target)).backward()
    cold, hot = pred.grad[0, 4, 0, 0, 0].item(), pred.grad[0, 4, 1, 0, 0].item()
    assert cold > 0 and hot / cold == pytest.approx(100.0, rel=1e-4)
    assert pred.grad[0, :4].abs().sum() == 0


def _lognormal_temperature(seed: int) -> torch.Tensor:
    """A batch of crops whose channel 4 is a smooth log-normal temperature field (range 3), the others noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, 32, 32, 32, generator=generator)
    x[:, 4] = torch.nn.functional.avg_pool3d(x[:, 4:5], 5, stride=1, padding=2, count_include_pad=False)[:, 0] / 3
    return x


def test_temperature_power_term_is_zero_for_the_truth_and_for_its_phases_and_positive_when_smoothed():
    """The term compares the temperature's power per shell, not its place: a mirrored copy costs nothing, a smoothed
    one costs about its lost power (in log), and only the temperature channel counts."""
    target = _lognormal_temperature(0)
    loss, l1 = Loss(lambda_T_power=1.0, temperature_log_range=3.0), Loss()

    def term(pred: torch.Tensor) -> float:
        return loss(pred, target).item() - l1(pred, target).item()

    assert term(target) == pytest.approx(0.0, abs=1e-6)
    assert term(target.flip(3)) == pytest.approx(0.0, abs=1e-5)
    assert l1(target.flip(3), target).item() > 0.5
    other_channels = target.clone()
    other_channels[:, :4] = 0
    assert term(other_channels) == pytest.approx(0.0, abs=1e-6)
    smoothed = target.clone()
    smoothed[:, 4] = torch.nn.functional.avg_pool3d(target[:, 4:5], 3, stride=1, padding=1)[:, 0]
    lightly = target.clone()
    lightly[:, 4] = 0.8 * target[:, 4] + 0.2 * smoothed[:, 4]
    assert term(smoothed) > term(lightly) > 0.01
    with pytest.raises(ValueError, match="lambda_T_power needs the temperature's normalization"):
        Loss(lambda_T_power=1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_temperature_power_term_has_finite_gradients_in_half_precision(dtype):
    """Computed in float32 whatever the prediction's precision: 10^(3 x) and the powers of a crop overflow float16."""
    target = _lognormal_temperature(1).to(dtype)
    pred = torch.nn.functional.avg_pool3d(target.float(), 3, stride=1, padding=1).to(dtype).requires_grad_()
    loss = Loss(lambda_T_power=1.0, temperature_log_range=3.0)(pred, target)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert pred.grad.dtype == dtype and torch.isfinite(pred.grad).all() and pred.grad[:, 4].abs().sum() > 0


def test_crop_power_puts_a_plane_wave_in_its_shell():
    x = torch.arange(16.0)
    wave = torch.cos(2 * torch.pi * 3 * x / 16)[None, None, :, None, None].expand(2, 1, 16, 16, 16)
    power = crop_power(wave)  # shells k = 1 .. 8
    assert power.shape == (1, 8)
    assert power[0, 2] > 1e6 * (power[0].sum() - power[0, 2])


def test_power_term_measures_power_whatever_the_phase():
    """Halving the field costs 3/4 of the power; a shifted copy (same power, other phases) costs nothing, though its
    L1 is large: the term asks for the amount of fluctuation at each scale, L1 for its place."""
    torch.manual_seed(0)
    target = torch.randn(4, 5, 16, 16, 16)
    power_only = Loss(lambda_pk=1.0)
    l1 = Loss()
    assert power_only(target, target).item() == pytest.approx(0.0, abs=1e-6)
    halved = power_only(target / 2, target).item() - l1(target / 2, target).item()
    assert halved == pytest.approx(0.75, rel=1e-4)
    flat = torch.zeros_like(target)
    assert power_only(flat, target).item() - l1(flat, target).item() == pytest.approx(1.0, rel=1e-4)
    shifted = target.roll(5, dims=2)
    assert power_only(shifted, target).item() - l1(shifted, target).item() == pytest.approx(0.0, abs=1e-5)
    assert l1(shifted, target).item() > 1.0


def test_power_term_has_gradients():
    pred = torch.randn(2, 5, 8, 8, 8, requires_grad=True)
    Loss(lambda_pk=1.0)(pred, torch.randn(2, 5, 8, 8, 8)).backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all() and pred.grad.abs().sum() > 0


def test_loss_density_term_does_not_overflow_in_half_precision():
    pred = torch.full((1, 5, 2, 2, 2), 0.9, dtype=torch.float16)  # exp(14 * 0.9) > float16's max
    target = torch.full((1, 5, 2, 2, 2), 0.8, dtype=torch.float16)
    loss = Loss(lambda_rho=1.0, lambda_pk=1.0)(pred + torch.rand_like(pred) / 10, target)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_the_last_layer_padded_to_8_channels_computes_the_same():
    """Zero filters appended to the last layer's 5 and their outputs dropped: the same outputs and gradients, the
    same parameters and state dict."""
    torch.manual_seed(0)
    plain = UNet(4, 5, width=4, depth=3)
    padded = UNet(4, 5, width=4, depth=3)
    padded.load_state_dict(plain.state_dict())
    padded.pad_last_layer(8)
    assert padded.last_padded_to == 8 and plain.last_padded_to == 5
    assert {k: v.shape for k, v in padded.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    x, y = torch.randn(2, 4, 16, 16, 16), torch.rand(2, 5, 16, 16, 16) - 0.5
    outputs = []
    for net in (plain, padded):
        out = net(x)
        Loss()(out, y).backward()
        outputs.append(out.detach())
    assert torch.allclose(outputs[0], outputs[1], rtol=1e-6, atol=1e-7)
    for p, q in zip(plain.parameters(), padded.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-9)


def test_velocity_terms_are_l1_of_the_velocity_and_of_its_divergence():
    gen = torch.Generator().manual_seed(4)
    pred, target = torch.rand(2, 5, 6, 6, 6, generator=gen), torch.rand(2, 5, 6, 6, 6, generator=gen)
    l1 = (pred - target).abs().mean().item()
    velocity = (pred[:, 1:4] - target[:, 1:4]).abs().mean().item()
    assert Loss(lambda_v=0.5)(pred, target).item() == pytest.approx(l1 + 0.5 * velocity, rel=1e-6)
    # a flow x along x: divergence 1 on the interior; none for a uniform flow
    ramp = torch.zeros(1, 5, 6, 6, 6)
    ramp[:, 1] = torch.arange(6.0)[:, None, None]
    uniform = torch.zeros(1, 5, 6, 6, 6)
    uniform[:, 1] = 2.5
    assert divergence(ramp[:, 1:4]).unique().tolist() == [1.0] and divergence(uniform[:, 1:4]).abs().max() == 0
    plain = Loss()(ramp, uniform).item()
    assert Loss(lambda_div=0.2)(ramp, uniform).item() == pytest.approx(plain + 0.2 * 1.0, rel=1e-6)
    swapped = Loss(lambda_v=1.0, velocity=(3, 2, 1))(pred, target).item()  # channels named, in any order
    assert swapped == pytest.approx(l1 + velocity, rel=1e-6)
