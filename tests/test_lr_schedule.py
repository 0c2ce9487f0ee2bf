import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, single_process_env
from trainer.lr_schedule import ScaledCosineSchedule


def _schedule(**kw):
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    args = dict(
        start_lr=2e-4, end_lr=1e-6, warmup_steps=10, total_steps=100, scaling="sqrt", global_batch=256, base_batch=64
    )
    args.update(kw)
    return opt, ScaledCosineSchedule(opt, **args)


def _run(opt, sched, steps):
    """The lr each of ``steps`` optimizer steps used, with DeepSpeed's order: step, then scheduler.step()."""
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])
        sched.step()
    return used


def test_sqrt_scaled_warmup_then_cosine_to_end_lr():
    opt, sched = _schedule()
    used = _run(opt, sched, 100)
    peak = 2e-4 * math.sqrt(256 / 64)
    for t in (1, 5, 10):
        assert used[t - 1] == pytest.approx(peak * t / 10)
    for t in (11, 40, 77):
        assert used[t - 1] == pytest.approx(1e-6 + 0.5 * (peak - 1e-6) * (1 + math.cos(math.pi * (t - 10) / 90)))
    assert used[-1] == pytest.approx(1e-6, abs=1e-15)  # end_lr exactly at the last step
    assert max(used) == pytest.approx(peak)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-6)  # and stays there past the end


@pytest.mark.parametrize("scaling, factor", [("linear", 4.0), ("none", 1.0)])
def test_other_scalings(scaling, factor):
    opt, sched = _schedule(scaling=scaling, end_lr=0.0)
    used = _run(opt, sched, 100)
    assert sched.peak == pytest.approx(2e-4 * factor)
    assert max(used) == pytest.approx(sched.lr_at(1 if sched.warmup_steps == 0 else sched.warmup_steps))
    assert used[-1] == 0.0


def test_no_warmup_at_base_batch_or_without_scaling():
    # The reference's rule: warm-up only when the lr is scaled up.
    for kw in ({"global_batch": 64}, {"scaling": "none"}):
        opt, sched = _schedule(**kw)
        assert sched.warmup_steps == 0
        first = _run(opt, sched, 1)[0]
        assert first == pytest.approx(1e-6 + 0.5 * (sched.peak - 1e-6) * (1 + math.cos(math.pi / 100)))


def test_state_dict_round_trip_resumes_the_curve():
    opt, sched = _schedule()
    straight = _run(opt, sched, 60)
    opt2, sched2 = _schedule()
    _run(opt2, sched2, 25)
    state = sched2.state_dict()
    opt3, sched3 = _schedule()
    sched3.load_state_dict(state)
    assert _run(opt3, sched3, 35) == pytest.approx(straight[25:])


def test_warmup_longer_than_training_is_an_error():
    with pytest.raises(ValueError, match="does not fit"):
        _schedule(warmup_steps=100, total_steps=100)


SKIPPED_STEPS = """
import torch, deepspeed
from tests.conftest import REPO
from trainer.dist import DistEnv
from trainer.engine import BatchPlan, load_ds_template, resolve_ds_config
from trainer.lr_schedule import ScaledCosineSchedule
from trainer.dist import init_distributed

device = init_distributed(DistEnv.from_environ(), 60.0)
template = load_ds_template(REPO / "ds_configs" / "ds_bf16.json")
config = resolve_ds_config(template, BatchPlan(2, 1, 1), 1e-3, device_type=device.type)
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
make = lambda opt: ScaledCosineSchedule(opt, start_lr=1e-3, end_lr=1e-5, warmup_steps=0, total_steps=10,
                                        scaling="none", global_batch=2, base_batch=2)
engine, _, _, schedule = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config,
                                              lr_scheduler=make)
if FOLLOW:
    schedule.follow(engine)
used = []
for step in range(1, 11):
    used.append(schedule.get_last_lr()[0])
    x = torch.randn(2, 4, device=engine.device, dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean() * (float("inf") if step in (2, 5, 8) else 1.0)  # inf gradients: skipped
    engine.backward(loss)
    engine.step()
print("skipped", engine.skipped_steps, "global", engine.global_steps, "taken", schedule.steps_taken)
print("lrs", *(repr(lr) for lr in used), "after", repr(schedule.get_last_lr()[0]))
print("expected", *(repr(schedule.lr_at(t)) for t in range(1, 11)))
"""


@pytest.mark.parametrize("follow", [True, False])
def test_steps_skipped_for_overflow_keep_the_schedule_at_the_engines_step(follow):
    """DeepSpeed skips the optimizer step, and the scheduler's, when gradients are not finite (fp16 overflow; bf16
    here, which a CPU runs and which skips the same way). Following the engine, the schedule still gives step t the
    lr of step t and ends at end_lr; without it, it falls behind by every skipped step."""
    script = SKIPPED_STEPS.replace("FOLLOW", str(follow))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=single_process_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.split()}
    assert lines["skipped"][:4] == ["3", "global", "10", "taken"]
    used = [float(v) for v in lines["lrs"][:10]]
    expected = [float(v) for v in lines["expected"]]
    if follow:  # step t has step t's lr, but for the step right after a skipped one, which has the skipped one's
        assert int(lines["skipped"][4]) == 10
        assert used == pytest.approx([expected[t - 2] if t - 1 in (2, 5, 8) else expected[t - 1] for t in range(1, 11)])
        assert used[-1] == float(lines["lrs"][-1]) == pytest.approx(1e-5)  # end_lr at the last step, and after it
    else:  # the behaviour that following fixes: 3 steps behind, well above end_lr at the end
        assert int(lines["skipped"][4]) == 7 and float(lines["lrs"][-1]) > 5e-5
