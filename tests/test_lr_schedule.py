import math

import pytest
import torch

from trainer.lr_schedule import ScaledCosineSchedule


def _schedule(**kw):
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    args = dict(start_lr=2e-4, end_lr=1e-6, warmup_steps=10, total_steps=100, scaling="sqrt", global_batch=256, base_batch=64)
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
