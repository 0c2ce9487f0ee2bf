"""A run that does not learn says so: trainer.numerics.LearningWatch on real DeepSpeed engines whose weights move,
whose weights do not (every gradient zero), and whose steps are skipped for overflow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, single_process_env

WATCHED = """
import json, logging, sys, torch, deepspeed
from tests.fp16_on_cpu import allow_fp16_on_cpu, gpu_ds_config
from trainer.dist import DistEnv, init_distributed
from trainer.engine import BatchPlan, load_ds_template, skip_single_rank_reduction
from trainer.numerics import LearningWatch
from trainer.step import train_step

class Collect(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())

warnings = []
logging.getLogger("trainer.numerics").addHandler(Collect())
allow_fp16_on_cpu()
init_distributed(DistEnv.from_environ({}), 60.0)
case = json.loads(sys.argv[1])
config = gpu_ds_config(load_ds_template(f"ds_configs/{case['json']}"), BatchPlan(4, 1, 1), 1e-2)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
skip_single_rank_reduction(engine)
if case["zero_gradients"]:
    for p in engine.module.parameters():
        p.register_hook(torch.zeros_like)
dtype = next(engine.module.parameters()).dtype
gen = torch.Generator().manual_seed(1)
loss_fn = lambda overflow: lambda out, y: (out.float() - y).abs().mean() * (float("inf") if overflow else 1.0)
reports = []
for step in range(1, case["steps"] + 1):
    if step == case["watch_from"]:  # as a run resumed at this step would
        watch = LearningWatch(engine, lr_at=lambda step: 1e-2, peak_lr=1e-2)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 5, generator=gen)
    x, y = x.to(engine.device, dtype), y.to(engine.device)
    seen = watch.after_backward if step >= case["watch_from"] else None
    train_step(engine, iter([(x, y)]), loss_fn=loss_fn(step in case["overflow"]), after_backward=seen)
    if step >= case["watch_from"] and (step - case["watch_from"] + 1) % case["log_every"] == 0:
        reports.append(vars(watch.report()))
print(json.dumps({"reports": reports, "warnings": warnings, "changed": watch.weights_changed(),
                  "skipped": engine.skipped_steps}))
"""


def watch(json_name: str, steps=8, log_every=4, zero_gradients=False, overflow=(), watch_from=1) -> dict:
    case = {"json": json_name, "steps": steps, "log_every": log_every, "zero_gradients": zero_gradients}
    case |= {"overflow": list(overflow), "watch_from": watch_from}
    command = [sys.executable, "-c", WATCHED, json.dumps(case)]
    result = subprocess.run(command, cwd=REPO, env=single_process_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("json_name", ["ds_fp32.json", "ds_fp16.json"])
def test_an_engine_that_learns_is_not_warned_about(json_name):
    seen = watch(json_name)
    assert seen["warnings"] == [] and seen["changed"] is True
    for report in seen["reports"]:
        assert report["weights_changed"] is True and report["grad_norm"] > 0 and report["skipped"] == 0
        assert (report["loss_scale"] == 2.0**16) if json_name == "ds_fp16.json" else report["loss_scale"] is None


@pytest.mark.parametrize("json_name", ["ds_fp32.json", "ds_fp16.json"])
def test_an_engine_whose_weights_do_not_move_is_warned_about_once(json_name):
    """Every gradient zero (a hook on each parameter): the weights stay bit-equal, the gradient norm is 0, and the
    run says once, at its first log point, that it is not learning."""
    seen = watch(json_name, zero_gradients=True)
    assert len(seen["warnings"]) == 1, seen["warnings"]
    expected = "the weights did not change over the 4 optimizer step(s) applied and the gradient norm is 0 up to step 4"
    assert seen["warnings"][0].startswith(expected) and "this run is not learning" in seen["warnings"][0]
    assert seen["changed"] is False
    assert all(r["weights_changed"] is False and r["grad_norm"] == 0.0 for r in seen["reports"])


def test_steps_skipped_after_the_loss_scale_search_are_warned_about():
    """fp16's first steps overflow while the loss scale searches downwards (not counted); one in two overflowing
    after the first applied step is warned about once the window's 20 steps are counted."""
    search = range(1, 4)
    quiet = watch("ds_fp16.json", steps=24, log_every=4, overflow=search)
    assert quiet["warnings"] == [] and quiet["skipped"] == 3
    assert [r["skipped"] for r in quiet["reports"]] == [3, 0, 0, 0, 0, 0]
    assert quiet["reports"][-1]["loss_scale"] == 2.0**13  # halved at each of the search's skips
    overflowing = watch("ds_fp16.json", steps=28, log_every=4, overflow=[*search, *range(6, 29, 2)])
    assert len(overflowing["warnings"]) == 1, overflowing["warnings"]
    # counted from step 4, the first applied: 10 of steps 4-24 skipped, at the log point where 20 steps are reached
    assert overflowing["warnings"][0].startswith("10 of the last 21 optimizer steps were skipped for overflow")


def test_the_loss_scale_search_after_a_resume_is_not_counted():
    """A run resumed with a loss scale too large for its gradients (a checkpoint of a run whose loss was never
    scaled, whose scale only grew) searches downwards again: those skips are not counted either."""
    resumed = watch("ds_fp16.json", steps=35, log_every=4, watch_from=8, overflow=range(8, 14))
    assert resumed["warnings"] == [] and resumed["skipped"] == 6  # counted, 6 of steps 8 to 27 would be 30%
    assert [r["skipped"] for r in resumed["reports"]] == [4, 2, 0, 0, 0, 0, 0]
