"""bench.remedies: arms become ds_train options, records become one table row per arm with its seeds side by side."""

import pytest

from bench.remedies import arm_options, table


def test_arms_become_options_and_a_malformed_one_is_named():
    assert arm_options("baseline") == []
    assert arm_options("lambda_T=0.1,num_epochs=10") == ["--lambda_T", "0.1", "--num_epochs", "10"]
    for bad in ("lambda_T", "=0.1", "lambda_T=", "lambda_T=0.1,"):
        with pytest.raises(ValueError, match="expected 'baseline' or key=value"):
            arm_options(bad)


def _record(arm, seed, ratio, wall_s):
    stats = {"power_ratio_min": ratio, "power_ratio_max": ratio + 0.1, "r_min": 0.99, "met": False}
    return {
        "config": "debug",
        "arm": arm,
        "seed": seed,
        "l1": {"gas_density": 0.001 * (seed + 1), "vx": 0.003, "vy": 0.004, "vz": 0.008, "temperature": 0.002},
        "target": {"k_max": 8, "power_tolerance": 0.1, "min_r": 0.95, "gas_density": stats, "temperature": stats},
        "velocity_target": {"speed": {"power_ratio_min": None, "power_ratio_max": None, "r_min": None, "met": None}},
        "train_wall_s": wall_s,
        "samples_per_s": 50.0,
        "global_batch": 16,
    }


def test_the_table_has_a_row_per_arm_with_the_newest_record_of_each_seed():
    records = [_record("baseline", 1, 0.5, 70), _record("baseline", 0, 0.4, 60), _record("baseline", 0, 0.6, 80)]
    records.append(_record("lambda_T=0.1", 0, 0.9, 90))
    rows = table(records).splitlines()
    assert len(rows) == 4
    assert rows[2] == (
        "| debug | baseline | 0 / 1 | 0.00100 / 0.00200 | 0.00500 / 0.00500 | 0.00200 / 0.00200 "
        "| 0.60-0.70, 0.990 / 0.50-0.60, 0.990 | 0.60-0.70, 0.990 / 0.50-0.60, 0.990 | - / - | 320 | 75 |"
    )
    assert rows[3].startswith("| debug | lambda_T=0.1 | 0 | 0.00100 |")
