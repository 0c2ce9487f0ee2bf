"""The gradient noise scale: its estimator against a problem whose noise scale is known exactly (least squares with
Gaussian inputs), measured through the training step itself, with accumulation and with a micro-batch split in two."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, single_process_env
from trainer.noise import NoiseScale, at_step, estimates

LEAST_SQUARES = """
import json, sys, torch, deepspeed
from tests.conftest import REPO
from trainer.dist import DistEnv, init_distributed
from trainer.engine import BatchPlan, load_ds_template, resolve_ds_config, skip_single_rank_reduction
from trainer.noise import NoiseScale
from trainer.step import train_step

micro, accumulation, pieces, steps = (int(a) for a in sys.argv[1:5])
template, plan = load_ds_template(REPO / "ds_configs" / sys.argv[5]), BatchPlan(micro, accumulation, 1)
device = init_distributed(DistEnv.from_environ(), 60.0)
if template.get("fp16", {}).get("enabled"):  # DeepSpeed's GPU fp16 path, its loss scale and all, on the CPU
    from tests.fp16_on_cpu import allow_fp16_on_cpu, gpu_ds_config
    allow_fp16_on_cpu()
    config = gpu_ds_config(template, plan, 0.0)
else:
    config = resolve_ds_config(template, plan, 0.0, device_type="cpu")
gen = torch.Generator().manual_seed(0)
d, sigma = 16, 0.5
w_star = torch.randn(d, generator=gen)
delta = torch.randn(d, generator=gen) / d**0.5
net = torch.nn.Linear(d, 1, bias=False)
with torch.no_grad():
    net.weight.copy_(w_star + delta)
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)  # lr 0: w stays
skip_single_rank_reduction(engine)
dtype = engine.module.weight.dtype
start = engine.module.weight.detach().float().squeeze(0).clone()
delta = start - w_star  # the weights as the engine holds them (rounded to fp16 there)
noise = NoiseScale(engine.module, small=micro // pieces, big=micro * accumulation, device=engine.device)
loss_fn = lambda out, y: 0.5 * (out.squeeze(-1).float() - y).square().mean()

def batches():
    while True:
        x = torch.randn(micro, d, generator=gen).to(dtype).float()
        yield x.to(dtype), x @ w_star + sigma * torch.randn(micro, generator=gen)

stream = batches()
for _ in range(steps):
    train_step(engine, stream, loss_fn=loss_fn, noise=noise, pieces=pieces)
estimate = noise.report()
g2 = float(delta.square().sum())
# per-sample gradient (delta.x - sigma eps) x: G = delta, tr(Sigma) = d (|delta|^2 + sigma^2) + |delta|^2
print(json.dumps({"b_simple": estimate.b_simple, "exact": (d * (g2 + sigma**2) + g2) / g2, "unchanged": bool(
    torch.equal(engine.module.weight.detach().float().squeeze(0), start)), "fp16": engine.fp16_enabled()}))
"""


def _measure(micro: int, accumulation: int, pieces: int, steps: int = 300, ds_json: str = "ds_fp32.json") -> dict:
    command = [sys.executable, "-c", LEAST_SQUARES, *map(str, (micro, accumulation, pieces, steps)), ds_json]
    result = subprocess.run(command, cwd=REPO, env=single_process_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "micro, accumulation, pieces", [(4, 8, 1), (8, 1, 2)], ids=["accumulated micro-batches", "halves"]
)
def test_the_noise_scale_of_least_squares_is_the_exact_one(micro, accumulation, pieces):
    measured = _measure(micro, accumulation, pieces)
    assert measured["unchanged"]  # learning rate 0: every step measures the same weights
    assert measured["b_simple"] == pytest.approx(measured["exact"], rel=0.2)


def test_under_fp16_the_loss_scale_is_divided_out():
    """DeepSpeed's fp16 path (a loss scale of 2^16 in every gradient the hooks see): the same noise scale."""
    measured = _measure(4, 8, 1, ds_json="ds_fp16.json")
    assert measured["fp16"] and measured["unchanged"]
    assert measured["b_simple"] == pytest.approx(measured["exact"], rel=0.2)


def test_the_estimates_undo_the_batch_sizes():
    """|G|^2 and tr(Sigma) from squared norms that follow E|g_B|^2 = |G|^2 + tr(Sigma) / B exactly."""
    grad_sq, trace = 2.0, 48.0
    small, big = 4, 32
    assert estimates(grad_sq + trace / small, grad_sq + trace / big, small=small, big=big) == pytest.approx(
        (grad_sq, trace)
    )


def test_only_the_first_eighth_of_each_log_interval_is_measured():
    assert [step for step in range(48) if NoiseScale.measures(step, every=20)] == [0, 1, 20, 21, 40, 41]
    assert [step for step in range(12) if NoiseScale.measures(step, every=4)] == [0, 4, 8]  # the first at least
    noise = NoiseScale(torch.nn.Linear(1, 1), small=1, big=2, device=torch.device("cpu"))
    assert at_step(noise, 2, step=20, every=20) == (noise, 2)  # measured: split in two
    assert at_step(noise, 2, step=5, every=20) == (None, 1)  # not: unsplit, nothing measured


def test_the_hooks_measure_only_inside_a_measured_backward():
    """An unmeasured step's backward leaves nothing; a measured one its gradient's squared norm, unscaled."""
    net = torch.nn.Linear(3, 1)
    noise = NoiseScale(net, small=1, big=2, device=torch.device("cpu"))
    net(torch.ones(1, 3)).sum().backward()
    assert noise._micro == [] and noise._squares == []
    with noise.micro_batch(2.0):
        (2 * net(torch.ones(1, 3)).sum()).backward()
    (measured,) = noise._micro
    assert float(measured) == pytest.approx(3 + 1)  # d/dW = x = (1, 1, 1), d/db = 1, the factor 2 divided out
