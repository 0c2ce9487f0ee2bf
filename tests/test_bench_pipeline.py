"""The pipeline benchmark's own pieces: its baseline does the same work, its table comes from the records."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench.env import DOC, REPO, update_doc
from bench.pipeline import AUG, PlainCopies, ReferenceStyleCrops, _latest_run, _time_batches, table
from bench.pipeline import main as pipeline_main
from pipeline.sampling import DrawPlan
from pipeline.volumes import VolumeFiles, VolumePair

# A run of bench.pipeline small enough for a test: batches of 4 tiny crops, one thread, two timed batches.
QUICK = ["--batch", "4", "--threads", "1", "--warmup", "1", "--batches", "2"]


def test_baseline_produces_the_reference_samples(tiny_data):
    plan = DrawPlan(seed=0, num_samples=48, batch_size=8, box_size=32, crop_size=8, rotate=True)
    dataset = ReferenceStyleCrops(tiny_data["train"], plan)
    volumes = VolumePair.open(VolumeFiles.hdf5(tiny_data["train"]), 4, 5, crop_size=8)
    for i in range(len(dataset)):
        inputs, targets = dataset[i]
        ref_inp, ref_tar = AUG.reference(volumes, plan.batch_draws(0, i // 8)[i % 8], 8)
        assert np.array_equal(inputs.numpy(), ref_inp) and np.array_equal(targets.numpy(), ref_tar)


def test_timing_discards_warmup_batches():
    consumed = []

    def batches():
        for i in range(10):
            consumed.append(i)
            yield i, i

    result = _time_batches(batches(), warmup=3, measured=5, device=torch.device("cpu"), batch=4)
    assert consumed == list(range(8))  # 3 discarded, 5 timed, none beyond
    assert result["samples_per_s"] == 20 / result["wall_s"]


def _record(case, rate, time="2026-01-01T00:00:00", crop=64):
    return {
        "bench": "pipeline",
        "case": case,
        "samples_per_s": rate,
        "samples_per_s_min": rate - 1,
        "samples_per_s_max": rate + 1,
        "crop": crop,
        "device": "cpu",
        "cpu": "x",
        "cores": 2,
        "box": 256,
        "batch": 32,
        "threads": 2,
        "dtype": "float32",
        "torch": "t",
        "dali": "d",
        "commit": "abc",
        "time": time,
        "host": "h",
    }


def test_table_uses_the_newest_run_and_ratios_to_its_baseline(tmp_path):
    records = [
        _record("baseline", 10.0, "2026-01-01"),
        _record("dali-host", 99.0, "2026-01-01"),
        _record("baseline", 50.0, "2026-02-01"),
        _record("dali-host", 80.0, "2026-02-01"),
        _record("limit", 320.0, "2026-02-01"),
    ]
    text = table(_latest_run(records))
    assert "| 64^3 | dali-host | 80.0 | 79 - 81 | 1.60x | 25% |" in text and "99.0" not in text
    assert "| 64^3 | limit | 320.0 | 319 - 321 | 6.40x | 100% |" in text
    assert "| 64^3 | dali-host | 99.0 | 98 - 100 | 9.90x | - |" in table(records[:2])  # runs from before the limit
    assert "| 64^3 | limit | 320.0 | 319 - 321 | - | 100% |" in table(records[-1:])  # a run stopped before its baseline
    doc = tmp_path / "benchmarks.md"
    doc.write_text("a\n<!-- bench:pipeline:start -->\nold\n<!-- bench:pipeline:end -->\nb\n")
    update_doc(doc, text)
    content = doc.read_text()
    assert "old" not in content and "1.60x" in content and content.startswith("a\n") and content.endswith("b\n")
    json.dumps(records)  # records stay plain JSON


def test_a_run_with_its_own_results_file_leaves_the_docs_alone(tiny_data, tmp_path, capsys):
    page = DOC.read_bytes()
    out = tmp_path / "pipeline.jsonl"
    pipeline_main(
        [
            "--data",
            str(tiny_data["train"]),
            "--crops",
            "8",
            *QUICK,
            "--repeats",
            "1",
            "--no_dali",
            "--out",
            str(out),
        ]
    )
    assert {r["case"] for r in map(json.loads, out.read_text().splitlines())} >= {"baseline", "torch-host"}
    assert DOC.read_bytes() == page
    assert f"docs/benchmarks.md not updated: --report --out {out} puts this table there" in capsys.readouterr().out
    copy = tmp_path / "page.md"
    copy.write_text("<!-- bench:pipeline:start -->\n<!-- bench:pipeline:end -->\n")
    pipeline_main(["--report", "--out", str(out), "--doc", str(copy)])
    assert "| 8^3 | torch-host |" in copy.read_text()


def test_the_limit_copies_the_same_crops_unrotated(tiny_data):
    volumes = VolumePair.open(VolumeFiles.hdf5(tiny_data["train"]), 4, 5, crop_size=8).load()
    plan = DrawPlan(seed=0, num_samples=10, batch_size=4, box_size=32, crop_size=8, rotate=True)
    limit = PlainCopies(volumes, plan, threads=2, device=torch.device("cpu"))
    batches = [(inputs.clone(), targets.clone()) for inputs, targets in limit]
    limit.close()
    assert [len(inputs) for inputs, _ in batches] == [4, 4, 2]
    for b, (inputs, targets) in enumerate(batches):
        for j, draw in enumerate(plan.batch_draws(0, b)):
            x, y, z = draw.corner
            assert np.array_equal(inputs[j].numpy(), volumes.nbody[:, x : x + 8, y : y + 8, z : z + 8])
            assert np.array_equal(targets[j].numpy(), volumes.hydro[:, x : x + 8, y : y + 8, z : z + 8])


def test_records_are_written_as_cases_finish_so_a_run_stopped_early_keeps_them(tiny_data, tmp_path):
    """A time limit can stop the benchmark mid-run: every case timed before that is in the results file."""
    out = tmp_path / "pipeline.jsonl"
    command = [
        sys.executable,
        "-m",
        "bench.pipeline",
        "--data",
        str(tiny_data["train"]),
        "--crops",
        "8",
        "16",
        *QUICK,
        "--repeats",
        "2",
        "--no_dali",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # the first case of the second crop size is being timed: stop the run there
            if line.startswith("crop 16^3, baseline, repeat 1"):
                proc.kill()
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["crop"], r["case"]) for r in records} >= {
        (8, "limit"),
        (8, "baseline"),
        (8, "torch-lazy"),
        (8, "torch-host"),
    }
    assert all(r["crop"] == 8 or r["case"] in ("limit", "baseline") for r in records)
    last = {(r["crop"], r["case"]): r["repeats"] for r in records}  # each case's newest record: the most repeats
    assert last[(8, "torch-host")] == 2 and last[(16, "limit")] == 1
    text = table(_latest_run(records))  # a run cut short still makes a table, without the ratios it lacks
    assert "| 8^3 | torch-host |" in text and "| 16^3 | limit |" in text


def test_cases_can_be_chosen_and_an_unknown_one_is_one_line(tiny_data, tmp_path, capsys):
    out = tmp_path / "pipeline.jsonl"
    common = ["--data", str(tiny_data["train"]), "--crops", "8", *QUICK, "--repeats", "1", "--no_dali"]
    pipeline_main([*common, "--out", str(out), "--cases", "limit", "torch-host"])
    assert [json.loads(line)["case"] for line in out.read_text().splitlines()] == ["limit", "torch-host"]
    with pytest.raises(SystemExit) as stop:
        pipeline_main([*common, "--out", str(out), "--cases", "dali-device"])
    assert str(stop.value).startswith("python -m bench.pipeline: error: no case dali-device here (limit, baseline,")
