"""The training benchmark's measuring code: FLOPs, percentiles, warm-up, records, report."""

import argparse
import json
import subprocess
import sys

import pytest

from bench.env import append_records, read_records
from bench.flops import model_flops, peak_flops, utilization
from bench.report import engine_overhead, newest_runs, scaling
from bench.report import main as report_main
from bench.sweep import PRESETS, check_cases, write_synthetic_data
from bench.train import percentiles, timed
from model.unet import UNetSpec, level_channels
from pipeline.synthetic import SyntheticSpec
from tests.conftest import REPO, TINY_ARGS, single_process_env
from trainer.config import Config
from trainer.engine import plan_batches
from trainer.lr_schedule import peak_lr
from trainer.step import phase


def analytic_unet_flops(cin: int, cout: int, width: int, depth: int, crop: int) -> tuple[float, float]:
    """Forward and training FLOPs of the U-Net, by hand: 2 x Cin x Cout x k^3 per output voxel of a convolution
    (per input voxel of a transposed one); backward computes the weight gradient of every layer and the input
    gradient of every layer but the first, each as many FLOPs as its forward."""
    k3, channels = 4**3, level_channels(width, depth)
    layers, previous, size = [], cin, crop
    for c in channels:  # down: Conv3d(k=4, s=2) halves the side
        size //= 2
        layers.append(2 * previous * c * k3 * size**3)
        previous = c
    for level in reversed(range(1, depth)):  # up: ConvTranspose3d from the level below, on its input voxels
        c_in = channels[level] if level == depth - 1 else 2 * channels[level]
        layers.append(2 * c_in * channels[level - 1] * k3 * (crop // 2 ** (level + 1)) ** 3)
    layers.append(2 * 2 * channels[0] * cout * k3 * (crop // 2) ** 3)  # last ConvTranspose3d
    forward = sum(layers)
    return float(forward), float(3 * forward - layers[0])


@pytest.mark.parametrize("width, depth, crop", [(4, 3, 16), (8, 4, 32), (64, 6, 64)])
def test_flops_match_an_independent_count(width, depth, crop):
    counted = model_flops(UNetSpec(in_channels=4, out_channels=5, width=width, depth=depth), crop)
    forward, training = analytic_unet_flops(4, 5, width, depth, crop)
    assert counted["forward_flops_per_sample"] == forward
    assert counted["train_flops_per_sample"] == training
    if width == 64:  # the reference network: the tutorial's 27 and 80 GFLOP
        assert round(forward / 1e9) == 27 and round(training / 1e9) == 80


def test_utilization_counts_every_device():
    flops = {"train_flops_per_sample": 80e9}
    one = utilization(1000.0, flops, "NVIDIA H200", precision="fp16")
    eight = utilization(8000.0, flops, "NVIDIA H200", precision="fp16", devices=8)
    assert one["achieved_tflops"] == pytest.approx(80.0) and one["mfu"] == pytest.approx(80e12 / 989.4e12)
    assert eight["mfu"] == pytest.approx(one["mfu"])
    assert "datasheet" in one["peak_source"]
    unknown = utilization(1.0, flops, "Some GPU", precision="fp16")
    assert unknown["mfu"] is None and "add it to bench/flops.py" in unknown["peak_source"]
    peak, source = peak_flops("cpu", "fp32")
    assert (peak is None) == ("unknown" in source)


def test_percentiles_interpolate_linearly():
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values, "x") == {"x_p50": 50.5, "x_p90": pytest.approx(90.1), "x_p99": pytest.approx(99.01)}
    assert percentiles([7.0], "y")["y_p99"] == 7.0


def test_warmup_steps_are_run_but_not_timed():
    calls = []

    def step() -> float:  # one phase per step, as the training step has its own
        calls.append(1)
        with phase("forward"):
            pass
        return 0.25

    result = timed(step, warmup=2, steps=3, cuda=False)
    assert len(calls) == 5
    marks = result["marks"]
    assert len(marks.step_ms()) == 3 and all(ms >= 0 for ms in marks.step_ms())
    assert len(marks.phase_ms("forward")) == 3  # the warm-up's phases are not on the clock
    assert result["data_wait_pct"] == pytest.approx(100 * 0.75 / result["wall_s"])


REQUIRED = {
    "bench",
    "sweep",
    "run_id",
    "case",
    "mode",
    "engine",
    "config",
    "world_size",
    "micro_batch",
    "accumulation",
    "global_batch",
    "precision",
    "crop",
    "parameters",
    "threads_per_rank",
    "warmup_steps",
    "timed_steps",
    "samples_per_s",
    "samples_per_s_min",
    "samples_per_s_max",
    "rounds",
    "wall_s",
    "step_ms_p50",
    "step_ms_p90",
    "step_ms_p99",
    "data_wait_pct",
    "mem_peak_gib",
    "mem_kind",
    "forward_flops_per_sample",
    "train_flops_per_sample",
    "device",
    "cpu",
    "cores",
    "host",
    "torch",
    "deepspeed",
    "python",
    "commit",
    "time",
}


def test_a_benchmark_run_writes_complete_records(tmp_path):
    out = tmp_path / "train.jsonl"
    data = tmp_path / "data"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.train",
            *TINY_ARGS,
            "--train_path",
            str(data / "train.h5"),
            "--val_path",
            str(data / "val.h5"),
            "--modes",
            "io",
            "synthetic",
            "full",
            "plain",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--sweep",
            "test",
            "--case",
            "tiny",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in records] == ["io", "synthetic", "full", "plain"]
    assert [r["engine"] for r in records] == ["deepspeed"] * 3 + ["plain"]
    for r in records:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["samples_per_s"] > 0 and r["step_ms_p50"] <= r["step_ms_p90"] <= r["step_ms_p99"]
        assert (r["world_size"], r["micro_batch"], r["global_batch"], r["timed_steps"], r["rounds"]) == (1, 8, 8, 3, 2)
        assert (
            r["train_flops_per_sample"]
            == model_flops(UNetSpec(in_channels=4, out_channels=5, width=4, depth=4), 16)["train_flops_per_sample"]
        )
        assert (r["optimizer"], r["zero_stage"]) == ("Adam", 0)  # torch's Adam on a CPU, under DeepSpeed
    for r in records[1:]:
        assert {
            "achieved_tflops",
            "mfu",
            "peak_source",
            "forward_ms_p50",
            "backward_ms_p50",
            "optimizer_ms_p50",
        } <= set(r)
        assert r["achieved_tflops"] == pytest.approx(r["samples_per_s"] * r["train_flops_per_sample"] / 1e12)


def test_bad_input_to_a_benchmark_is_one_line(tmp_path):
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.train",
            *TINY_ARGS,
            "--synthetic",
            "null",
            "--train_path",
            str(truncated),
            "--modes",
            "io",
            "--out",
            str(tmp_path / "train.jsonl"),
        ],
        cwd=REPO,
        env=single_process_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {truncated}: not a readable HDF5 file")
    assert "Traceback" not in result.stderr and not (tmp_path / "train.jsonl").exists()


def _record(**kw):
    base = {
        "bench": "train",
        "device": "cpu",
        "run_id": "1",
        "sweep": "baseline",
        "case": "c",
        "mode": "synthetic",
        "world_size": 1,
        "samples_per_s": 10.0,
        "step_ms_p50": 100.0,
        "step_ms_p90": 110.0,
        "step_ms_p99": 120.0,
        "precision": "fp32",
        "micro_batch": 8,
        "accumulation": 1,
        "global_batch": 8,
        "data_wait_pct": 0.0,
        "mem_peak_gib": 1.0,
        "mem_kind": "host_rss",
        "cpu": "x",
        "cores": 2,
        "torch": "t",
        "deepspeed": "d",
        "commit": "c",
        "timed_steps": 3,
        "warmup_steps": 1,
        "unet_width": 4,
        "unet_depth": 4,
        "crop": 16,
        "train_flops_per_sample": 1e9,
        "forward_ms_p50": 30.0,
        "backward_ms_p50": 60.0,
        "optimizer_ms_p50": 10.0,
    }
    return {**base, **kw}


def test_report_takes_the_newest_run_and_derives_ratios(tmp_path):
    records = [
        _record(run_id="1", samples_per_s=1.0),
        _record(run_id="2"),
        _record(run_id="2", mode="plain", step_ms_p50=80.0),
        _record(run_id="2", sweep="weak", world_size=1, samples_per_s=10.0),
        _record(run_id="2", sweep="weak", world_size=2, samples_per_s=16.0),
        _record(run_id="2", sweep="weak", world_size=2, samples_per_s=30.0, repeat=1),
        _record(run_id="2", sweep="weak", world_size=2, samples_per_s=2.0, repeat=2),
        _record(run_id="2", sweep="micro-batch", micro_batch=4, samples_per_s=7.0),
    ]
    rows = newest_runs(records)["cpu"]
    assert len(rows) == 7
    assert engine_overhead(rows) == [("fp32", 1.25)]
    assert scaling(rows, "weak") == [(1, 10.0, 1.0), (2, 16.0, 0.8)]
    results = tmp_path / "train.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("x\n<!-- bench:train:start -->\n<!-- bench:train:end -->\n")
    report_main(["--results", str(results), "--plots", str(tmp_path), "--doc", str(doc)])
    text = doc.read_text()
    assert "engine step / plain PyTorch step (fp32, same model and batch): **1.250**" in text
    assert "weak scaling efficiency, DeepSpeed (median samples/s over repeated runs): 2 ranks **0.80**" in text
    for png in ("scaling_cpu.png", "steps_cpu.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_case_of_a_preset_is_a_valid_run(preset, tmp_path, monkeypatch):
    """A typo in a GPU preset would surface only on a GPU machine, in its short loan: here every case's options
    parse into a config whose batches fit the case's ranks, with a DeepSpeed JSON that resolves on its device."""
    monkeypatch.chdir(REPO)  # the presets name files relative to the repository, as the sweep runs them
    base, cases = PRESETS[preset](8)
    # Options the sweep does not know go to every case, after the case's own.
    sweep = argparse.Namespace(steps=10, warmup=3, out=tmp_path / "train.jsonl", train_options=["--backend", "torch"])
    assert cases
    device = "cuda" if preset.startswith("gpu") else "cpu"
    for case, (args, cfg, ds_config) in zip(cases, check_cases(base, cases, sweep, device_type=device), strict=True):
        assert (args.modes, args.case, args.out, cfg.backend) == (case.modes, case.label, sweep.out, "torch")
        plan = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, case.ranks)
        assert ds_config["train_batch_size"] == plan.global_batch
        sched = cfg.lr_schedule  # the run's own peak learning rate, scaled to its global batch
        peak = peak_lr(sched.start_lr, sched.scaling, cfg.global_batch_size, base_batch=cfg.base_batch_size)
        assert ds_config["optimizer"]["params"]["lr"] == pytest.approx(peak)
    if preset == "gpu-comm":  # ZeRO 2's settings really differ from the JSON's own
        checked = zip(cases, check_cases(base, cases, sweep, device_type=device), strict=True)
        settings = {
            c.label.split(", ")[-1]: ds["zero_optimization"] for c, (_, _, ds) in checked if c.sweep == "zero2-settings"
        }
        assert settings["bucket 5e8"]["reduce_bucket_size"] == 500_000_000
        assert settings["no overlap"]["overlap_comm"] is False
        assert settings["bucket 5e8"]["stage"] == 2 and settings["no overlap"]["reduce_bucket_size"] == 50_000_000
        overlapped = {
            c.label: cfg
            for c, (_, cfg, _) in zip(cases, check_cases(base, cases, sweep, device_type=device), strict=True)
            if c.sweep == "weak-overlapped25"
        }
        assert overlapped and all(
            c.gradient_reduction == "overlapped" and c.reduce_bucket_mb == 25 for c in overlapped.values()
        )


def test_a_time_limited_gpu_speed_sweep_measures_the_plain_paths_first_on_data_written_before_it(tmp_path, monkeypatch):
    """The headline case first (its own sweep, which the GPU session runs before the rest), against the plain loop;
    compiling the 117M-parameter U-Net takes minutes: the plain path of both precisions comes before it, and no
    case pays for writing the 256^3 box."""
    monkeypatch.chdir(REPO)
    base, cases = PRESETS["gpu-speed"](1)
    assert [(c.sweep, c.label) for c in cases[:5]] == [
        ("headline", "fp16 channels_last + cudnn.benchmark"),
        ("speed", "fp16 plain path"),
        ("speed", "bf16 plain path"),
        ("speed", "fp16 all fast paths"),
        ("speed", "bf16 all fast paths"),
    ]
    assert cases[0].modes == ["synthetic", "full", "plain"]
    cfg = Config(
        synthetic=SyntheticSpec(train_box_size=16, val_box_size=16, seed=0),
        train_path=str(tmp_path / "train.h5"),
        val_path=str(tmp_path / "val.h5"),
    )
    write_synthetic_data([cfg, cfg])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.h5", "val.h5"]


@pytest.mark.parametrize(
    "preset, options, message",
    [
        ("gpu", ["--deepspeed_overrides", "{zero_optimization: {reduce_bucket_sise: 5}}"], "DeepSpeed rejects .*_sise"),
        ("gpu", ["--deepspeed_overrides", "{zero_optimisation: {stage: 2}}"], "did you mean 'zero_optimization'"),
        ("gpu-comm", ["--deepspeed_config", "ds_configs/missing.json"], "cannot read DeepSpeed config"),
        ("gpu-comm", ["--global_batch_size", "60"], "not divisible by the world size"),
        ("gpu", ["--deepspeed_overrides", "[1]"], "--deepspeed_overrides must be a mapping, got \\[1\\]"),
    ],
)
def test_a_bad_case_stops_the_sweep_before_it_starts(preset, options, message, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    base, cases = PRESETS[preset](8)
    options = ["--backend", "torch", *options]
    sweep = argparse.Namespace(steps=10, warmup=3, out=tmp_path / "train.jsonl", train_options=options)
    with pytest.raises(SystemExit, match=message):
        check_cases(base, cases, sweep, device_type="cuda")


def test_the_users_deepspeed_overrides_merge_with_a_cases_own(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    base, cases = PRESETS["gpu-comm"](8)
    options = ["--backend", "torch", "--deepspeed_overrides", "{optimizer: {params: {torch_adam: true}}}"]
    sweep = argparse.Namespace(steps=10, warmup=3, out=tmp_path / "train.jsonl", train_options=options)
    checked = dict(zip((c.label for c in cases), check_cases(base, cases, sweep, device_type="cuda"), strict=True))
    _, cfg, ds_config = checked["8 rank(s), micro 64, ZeRO 2, bucket 5e8"]
    assert cfg.deepspeed_overrides["zero_optimization"]["reduce_bucket_size"] == 500_000_000  # the case's own
    assert ds_config["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert ds_config["optimizer"]["params"]["torch_adam"] is True  # and the user's, on every case
    assert all(ds["optimizer"]["params"]["torch_adam"] is True for _, _, ds in checked.values())


def test_results_cut_short_keep_their_whole_records_and_a_missing_file_is_one_line(tmp_path, capsys):
    """A time-limited benchmark run's timeout can kill it while it writes its last record."""
    path = tmp_path / "train.jsonl"
    whole = [_record(run_id="1"), _record(run_id="1", mode="plain")]
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + json.dumps(_record())[:40])
    assert read_records(path) == whole
    assert f"{path} line 3 is not a JSON record" in capsys.readouterr().err
    after = _record(run_id="2")
    append_records(path, [after])  # the next run's record starts a line of its own, after the fragment
    assert read_records(path) == [*whole, after]
    (tmp_path / "empty.jsonl").write_text("\n")
    for name, message in [("none.jsonl", "no such file {}"), ("empty.jsonl", "{}: no records")]:
        with pytest.raises(SystemExit) as exit_:
            report_main(["--results", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "error: " in err and message.format(tmp_path / name) in err


def test_the_comm_preset_says_one_gpu_has_nothing_to_compare():
    with pytest.raises(SystemExit, match="compares reductions over several GPUs: this machine has one"):
        PRESETS["gpu-comm"](1)
