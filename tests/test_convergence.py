"""The convergence study's arithmetic: each run's plan, the steps to the base's loss read off the curves, the fit of
S(B) = S_min + E_min / B, and the projection to N GPUs on given inputs."""

from __future__ import annotations

import pytest

from studies.convergence import Base, Run
from studies.convergence_report import best_steps, fit, reached, table, targets
from studies.projection import BACKWARD_SHARE, Inputs, allreduce_ms, project, steps_at, worth_it

BASE = Base(batch=4, lr_base_batch=4, steps=512, validations=8, start_lr=1e-3, warmup=16, max_micro=32)


def test_a_run_plans_its_batch_steps_validations_and_learning_rate():
    half = BASE.plan(Run(multiple=16, rule="sqrt", epochs_rule="half", seed=0))
    assert (half["global_batch"], half["steps"], half["peak_lr"], half["warmup_steps"]) == (64, 256, 4e-3, 16)
    options = half["options"]
    assert options[options.index("--micro_batch_size") + 1] == "32"  # 64 by accumulating 2 micro-batches of 32
    assert options[options.index("--Nsamples") + 1] == str(256 // 8 * 64)  # a validation every 32 steps
    same_samples = BASE.plan(Run(multiple=64, rule="linear+warmup4", epochs_rule="samples", seed=1))
    assert (same_samples["steps"], same_samples["peak_lr"]) == (8, 64e-3)
    assert same_samples["warmup_steps"] == 2  # a quarter of a run this short
    unscaled = BASE.plan(Run(multiple=16, rule="none", epochs_rule="half", seed=0))
    assert unscaled["warmup_steps"] == 0 and unscaled["peak_lr"] == 1e-3
    base = BASE.plan(Run(multiple=1, rule="base", epochs_rule="base", seed=0))
    assert base["steps"] == 512 and "--lr_schedule.scaling" not in base["options"]
    with pytest.raises(ValueError, match="do not split into 8 validations"):
        BASE.plan(Run(multiple=128, rule="sqrt", epochs_rule="samples", seed=0))


def _record(multiple, rule, epochs, seed, losses, *, batch=4):
    steps = [s * (64 // multiple if epochs == "samples" else 32) for s in range(len(losses))]
    return {
        "multiple": multiple,
        "rule": rule,
        "epochs_rule": epochs,
        "seed": seed,
        "global_batch": batch * multiple,
        "steps": steps[-1],
        "peak_lr": 1e-3,
        "curve": [
            {"step": s, "samples": s * batch * multiple, "time_s": s, "loss": loss}
            for s, loss in zip(steps, losses, strict=True)
        ],
        "final_val_loss": losses[-1],
        "b_simple": [[steps[-1], 40.0]],
        "train_wall_s": 10.0,
    }


def test_steps_to_the_base_loss_are_read_off_the_curves_and_fitted():
    records = [
        _record(1, "base", "base", 0, [0.5, 0.2, 0.1]),
        _record(4, "sqrt", "half", 0, [0.5, 0.15, 0.09]),
        _record(4, "none", "half", 0, [0.5, 0.3, 0.2]),
    ]
    runs = {(r["multiple"], r["rule"], r["epochs_rule"], r["seed"]): r for r in records}
    assert targets(runs) == {0: 0.1}
    assert reached(records[1], 0.1)["step"] == 64 and reached(records[2], 0.1) is None
    assert best_steps(runs, targets(runs)) == {0: {4: ("base", 64), 16: ("sqrt, half", 64)}}
    text = table(records)
    assert "not reached" in text and "| 16 | sqrt | half |" in text


def test_the_fit_recovers_s_min_and_e_min():
    s_min, e_min = fit([(b, 100 + 2000 / b) for b in (4, 16, 64)])
    assert (s_min, e_min) == (pytest.approx(100), pytest.approx(2000))
    assert fit([(4, 600.0)]) is None


def test_the_projection_is_arithmetic_on_its_inputs():
    inputs = Inputs(s_min=100, e_min=2000, study_base_batch=4, step_ms=30.0, gradient_bytes=1e9, bandwidth_gbs=100)
    assert allreduce_ms(inputs, 1) == 0 and allreduce_ms(inputs, 2) == pytest.approx(10.0 + 0.01)
    assert steps_at(inputs, 1) == inputs.base_steps
    assert steps_at(inputs, 8) == pytest.approx(inputs.base_steps * (100 + 2000 / 32) / (100 + 2000 / 4))
    plain, hidden = project(inputs, 8), project(Inputs(**{**vars(inputs), "overlap": True}), 8)
    assert plain["exposed_ms"] == plain["allreduce_ms"] == pytest.approx(2 * 7 / 8 * 10 + 2 * 7 * 0.005)
    assert hidden["exposed_ms"] == pytest.approx(max(0.0, plain["allreduce_ms"] - BACKWARD_SHARE * 30.0))
    assert plain["minutes"] == pytest.approx(plain["steps"] * (30.0 + plain["exposed_ms"]) / 60_000)
    rows = [{"gpus": n, "minutes": m} for n, m in ((1, 100.0), (4, 30.0), (8, 29.0), (32, 20.0))]
    assert worth_it(rows) == 4  # 8 GPUs buy less than 5% over 4
