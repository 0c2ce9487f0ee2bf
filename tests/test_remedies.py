"""studies.remedies: arms become ds_train options, records become one table row per arm with its seeds side by side."""

import pytest

from bench.env import REPO
from studies.remedies import arm_options, figure, range_table, shell_table, table, universe
from trainer.config import load_named


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
        "target": {
            "gas_density": stats,
            "temperature": stats,
            "vx": {"power_ratio_min": 0.9, "power_ratio_max": 1.1, "r_min": 0.94, "met": False, "judged": True},
            "vy": {"power_ratio_min": 0.8, "power_ratio_max": 1.2, "r_min": 0.93, "met": False, "judged": True},
            "vz": {"power_ratio_min": 0.95, "power_ratio_max": 1.05, "r_min": 0.96, "met": True, "judged": True},
            "speed": {"power_ratio_min": None, "power_ratio_max": None, "r_min": None, "met": None, "judged": False},
        },
        "train_wall_s": wall_s,
        "samples_per_s": 50.0,
        "global_batch": 16,
    }


def test_the_table_has_a_row_per_arm_with_the_newest_record_of_each_seed():
    records = [_record("baseline", 1, 0.5, 70), _record("baseline", 0, 0.4, 60), _record("baseline", 0, 0.6, 80)]
    older = _record("lambda_T=0.1", 0, 0.9, 90)  # records from before the target judged the velocities
    older["velocity_target"] = {field: older["target"].pop(field) for field in ("vx", "vy", "vz", "speed")}
    rows = table([*records, older]).splitlines()
    assert len(rows) == 4
    assert rows[2] == (
        "| debug | baseline | 0 / 1 | 0.00100 / 0.00200 | 0.00500 / 0.00500 | 0.00200 / 0.00200 "
        "| 0.60-0.70, 0.990 / 0.50-0.60, 0.990 | 0.60-0.70, 0.990 / 0.50-0.60, 0.990 "
        "| 0.90-1.10, 0.940 / 0.90-1.10, 0.940 | 0.80-1.20, 0.930 / 0.80-1.20, 0.930 "
        "| 0.95-1.05, 0.960 / 0.95-1.05, 0.960 | - / - | 320 | 75 |"
    )
    assert (
        rows[3].startswith("| debug | lambda_T=0.1 | 0 | 0.00100 |")
        and "| 0.90-1.10, 0.940 | 0.80-1.20, 0.930 |" in rows[3]
    )


def test_the_range_table_gives_the_medians_per_k_range_and_leaves_out_records_without_them():
    summary = {
        f"{field}_{stat}_{name}": value
        for field, base in (("gas_density", 1.0), ("temperature", 1.5))
        for stat, offset in (("power_ratio", 0.0), ("r", -0.5))
        for name, step in (("large_scales", 0.01), ("intermediate", 0.02), ("small_scales", 0.03))
        for value in [base + offset + step]
    }
    summary["temperature_power_ratio_intermediate"] = None  # a range the truth does not resolve
    ranged = _record("lambda_T=0.1", 0, 0.9, 90) | {
        "k_ranges": {"large_scales": [1, 8], "intermediate": [9, 32], "small_scales": [33, 64]},
        "summary": summary,
    }
    rows = range_table([_record("baseline", 0, 0.5, 70), ranged]).splitlines()
    assert len(rows) == 3
    assert rows[2] == "| debug | lambda_T=0.1 | 0 | 1-8 / 9-32 | 1.010, 0.510 | 1.020, 0.520 | 1.510, 1.010 | - |"


def test_a_universe_other_than_the_configs_gets_its_own_boxes_beside_the_configs():
    cfg = load_named(REPO / "ds_configs" / "UNet.yaml", "science")
    own = universe(cfg, None)
    assert (own.seed, own.options, own.suffix) == (10, (), "") and own.val_path == str(REPO / cfg["val_path"])
    assert own.train_path == str(REPO / cfg["train_path"])
    assert universe(cfg, 10) == own
    other = universe(cfg, 20)
    assert other.options == (
        "--synthetic.seed",
        "20",
        "--train_path",
        "data/synthetic/science-20/train.h5",
        "--val_path",
        "data/synthetic/science-20/val.h5",
    )
    assert (other.seed, other.suffix, other.val_path) == (20, "-u20", str(REPO / "data/synthetic/science-20/val.h5"))
    assert other.train_path == str(REPO / "data/synthetic/science-20/train.h5")
    with pytest.raises(ValueError, match="needs a config with synthetic boxes"):
        universe(load_named(REPO / "ds_configs" / "UNet.yaml", "base"), 20)


def test_the_shell_table_gives_the_temperatures_power_per_quarter_of_the_target_and_names_the_universe():
    k = list(range(1, 21))
    record = _record("lambda_T_power=0.03", 2, 0.9, 90) | {
        "universe": 20,
        "k_max": 16,
        "shells": {
            "temperature": {"k": k, "power_ratio": [1.0 - 0.01 * i for i in k], "r": [0.999 - 0.001 * i for i in k]},
            "gas_density": {"k": k, "power_ratio": [1.0 + 0.002 * i for i in k], "r": [0.995] * 20},
        },
    }
    rows = shell_table([_record("baseline", 0, 0.5, 70), record]).splitlines()
    assert len(rows) == 3
    assert rows[2] == (
        "| debug | lambda_T_power=0.03 (universe 20) | 2 | k 1-4: 0.960-0.990; k 5-8: 0.920-0.950; "
        "k 9-12: 0.880-0.910; k 13-16: 0.840-0.870 | 0.983 | 1.002-1.032, 0.995 |"
    )
    assert "(universe 20)" in table([record]).splitlines()[2]


def test_the_figure_pairs_each_run_with_its_calibrated_twin(tmp_path):
    k = list(range(1, 33))
    shells = {f: {"k": k, "power_ratio": [1.0] * 32, "r": [0.99] * 32} for f in ("gas_density", "temperature")}
    trained = _record("baseline", 2, 0.9, 90) | {"universe": 20, "k_max": 16, "shells": shells}
    with pytest.raises(ValueError, match="no run with its calibrated twin"):
        figure([trained], tmp_path / "alone.png")
    path = figure([trained, trained | {"arm": "baseline +gains"}], tmp_path / "pair.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
