"""fp16 trains: the loss scale is applied exactly once, whether DeepSpeed applies it itself or not.

DeepSpeed 0.19.8 divides fp16 gradients by the loss scale in its optimizer wrappers' step() but, at ZeRO stage 0,
never multiplies the loss by it: gradients below fp16's smallest number become zero and the weights freeze. These
tests run DeepSpeed's GPU fp16 path on the CPU (tests/fp16_on_cpu.py) and compare with the fp32 gradients.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, single_process_env

GRADIENTS = """
import json, sys, torch, deepspeed
from model import Loss, UNet
from tests.fp16_on_cpu import allow_fp16_on_cpu, gpu_ds_config
from trainer.dist import DistEnv, init_distributed
from trainer.engine import BatchPlan, load_ds_template, skip_single_rank_reduction
from trainer.step import train_step

allow_fp16_on_cpu()
init_distributed(DistEnv.from_environ({}), 60.0)
gen = torch.Generator().manual_seed(1)
x, y = torch.randn(2, 4, 8, 8, 8, generator=gen), torch.rand(2, 5, 8, 8, 8, generator=gen) - 0.5
torch.manual_seed(0)
reference = UNet(4, 5, width=4, depth=2)
Loss()(reference(x), y).backward()
for case in json.loads(sys.argv[1]):
    name, accumulation = case["json"], case["accumulation"]
    adam = {"optimizer": {"params": {"torch_adam": case["torch_adam"]}}}
    config = gpu_ds_config(load_ds_template(f"ds_configs/{name}", adam), BatchPlan(2, accumulation, 1), 1e-3)
    torch.manual_seed(0)
    net = UNet(4, 5, width=4, depth=2)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    skip_single_rank_reduction(engine)
    if case["deepspeed_scales"]:  # as deepspeedai/DeepSpeed#8393 would: the loss scaled inside engine.backward
        unscaled = engine.backward
        engine.backward = lambda loss, **kw: unscaled(loss * engine.optimizer.loss_scale, **kw)
    grads = {}  # what backward leaves for the optimizer, summed over the micro-batches, before it unscales them
    for n, p in engine.module.named_parameters():
        p.register_hook(lambda g, n=n: grads.__setitem__(n, grads.get(n, 0) + g.float().cpu()))
    scale = engine.optimizer.loss_scale if engine.fp16_enabled() else 1.0
    dtype = next(engine.module.parameters()).dtype
    batch = (x.to(engine.device, dtype), y.to(engine.device))
    train_step(engine, iter([batch] * accumulation), loss_fn=Loss())
    ratios = [float(grads[n].norm() / p.grad.norm()) for n, p in reference.named_parameters()]
    cosines = [float(torch.nn.functional.cosine_similarity(grads[n].flatten(), p.grad.flatten(), dim=0))
               for n, p in reference.named_parameters()]
    record = {"case": case, "scale": scale, "ratios": ratios, "cosines": cosines, "steps": engine.global_steps,
              "optimizer": type(engine.optimizer).__name__}
    print(json.dumps(record))
"""


def _case(json_name: str, accumulation: int = 1, deepspeed_scales: bool = False, torch_adam: bool = True) -> dict:
    return {
        "json": json_name,
        "accumulation": accumulation,
        "deepspeed_scales": deepspeed_scales,
        "torch_adam": torch_adam,
    }


# With torch's Adam, DeepSpeed wraps it in its unfused fp16 optimizer; with its own FusedAdam (a JIT build of its CPU
# op here, once), in its flat fp16 optimizer, as on a GPU by default.
CASES = {
    "fp16 ZeRO 0": _case("ds_fp16.json"),
    "fp16 ZeRO 0, accumulation 2": _case("ds_fp16.json", 2),
    "fp16 ZeRO 0, DeepSpeed's FusedAdam": _case("ds_fp16.json", 2, torch_adam=False),
    "fp16 ZeRO 0, a DeepSpeed that scales": _case("ds_fp16.json", 2, deepspeed_scales=True),
    "fp16 ZeRO 1": _case("ds_fp16_zero1.json", 2),
    "bf16": _case("ds_bf16.json"),
    "fp32": _case("ds_fp32.json"),
}
OPTIMIZERS = {"fp16 ZeRO 0": "FP16_UnfusedOptimizer", "fp16 ZeRO 0, DeepSpeed's FusedAdam": "FP16_Optimizer"}


def run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", script, *args]
    return subprocess.run(command, cwd=REPO, env=single_process_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gradients() -> dict[str, dict]:
    """Each case's gradients against the fp32 reference's, one process for all of them."""
    result = run_script(GRADIENTS, json.dumps(list(CASES.values())))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {name: next(r for r in records if r["case"] == case) for name, case in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_are_the_fp32_ones_times_the_loss_scale_once(gradients, name):
    """Before the optimizer unscales them, every parameter's gradient is the fp32 reference's times the loss scale
    (2^16 under fp16, 1 for bf16 and fp32): not 1 where DeepSpeed forgets it, not its square where both apply it."""
    record = gradients[name]
    expected = 2.0**16 if name.startswith("fp16") else 1.0
    assert record["scale"] == expected
    tolerance = {"fp32": 1e-4, "bf16": 0.05}.get(name, 0.02)  # fp16 and bf16 weights and inputs round
    assert record["ratios"] == pytest.approx([expected] * len(record["ratios"]), rel=tolerance), record["ratios"]
    assert min(record["cosines"]) > 1 - tolerance
    assert record["steps"] == 1
    assert record["optimizer"] == OPTIMIZERS.get(name, record["optimizer"])


def test_an_fp16_run_with_two_to_the_25_outputs_per_micro_batch_learns(tmp_path):
    """26 crops of 5 x 64^3 (2^25.0 outputs) per micro-batch: the L1 mean's gradient, 1/N, is below float16's
    smallest number unless the loss is scaled. The run's first step changes the weights and the validation loss, says
    which loss scale and gradient norm it trains with, and does not warn."""
    boxes = json.dumps({"train_box_size": 64, "val_box_size": 64, "seed": 3})
    args = ["--config", "debug", "--deepspeed_config", "ds_configs/ds_fp16.json", "--synthetic", boxes]
    args += ["--train_path", str(tmp_path / "train.h5"), "--val_path", str(tmp_path / "val.h5")]
    args += [
        "--data_size",
        "64",
        "--unet_depth",
        "2",
        "--unet_width",
        "1",
        "--num_epochs",
        "1",
        "--log_every_steps",
        "1",
    ]
    args += ["--Nsamples", "52", "--Nsamples_val", "26", "--global_batch_size", "26", "--base_batch_size", "26"]
    args += ["--num_data_workers", "1", "--lr_schedule.start_lr", "1e-2", "--run_dir", str(tmp_path / "run")]
    command = [sys.executable, "-m", "tests.fp16_on_cpu", *args]
    result = subprocess.run(command, cwd=REPO, env=single_process_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == "fp16" and summary["micro_batch"] * 5 * 64**3 >= 2**25
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1e-4, summary
    assert summary["weights_changed"] is True and summary["last_loss_scale"] == 2.0**16
    assert "does not apply its loss scale in backward with FP16_UnfusedOptimizer: the trainer does" in result.stderr
    assert "epoch 1 step 1: loss" in result.stderr and "loss scale 65536, 0 skipped" in result.stderr
    assert "grad norm 0," not in result.stderr and "not learning" not in result.stderr
