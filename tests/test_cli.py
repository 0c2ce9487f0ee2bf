"""The command line as a newcomer meets it: one-line errors, a helpful --help, paths of the wrong kind refused,
the install's choice of torch build, and TensorBoard started as the README says."""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.conftest import REPO, run_train
from trainer.config import named_configs

# Every command a user runs, as (module, main's name).
COMMANDS = {
    "ds_train": ("ds_train", "main"),
    "model.predict": ("model.predict", "main"),
    "model.export": ("model.export", "main"),
    "pipeline.convert": ("pipeline.convert", "main"),
    "pipeline.synthetic": ("pipeline.synthetic", "main"),
    "trainer.hostfile": ("trainer.hostfile", "main"),
    "bench.train": ("bench.train", "main"),
    "bench.sweep": ("bench.sweep", "main"),
    "bench.pipeline": ("bench.pipeline", "main"),
    "bench.report": ("bench.report", "main"),
    "bench.soak": ("bench.soak", "main"),
}


def _run_main(command: str, argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of a command's main, called as its module's __main__ would call it."""
    module, name = COMMANDS[command]
    main = getattr(importlib.import_module(module), name)
    if command == "model.export":
        main = importlib.import_module("model.emulator").main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"trainer.hostfile"}))
def test_an_unknown_option_is_one_line_with_a_hint(command, capsys):
    code, err = _run_main(command, ["--bogus_option_x", "3"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "error: unknown option --bogus_option_x" in err


def test_a_misspelled_option_names_the_closest_and_a_moved_reference_option_says_where_it_went(capsys):
    code, err = _run_main("ds_train", ["--num_epoch", "3"], capsys)
    assert code == 2 and err.strip() == "ds_train.py: error: unknown option --num_epoch (did you mean --num_epochs?)"
    code, err = _run_main("ds_train", ["--config", "base", "--full_scale", "true"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown option --full_scale: unet_depth (6 = full_scale: True, 5 = full_scale: False)" in err
    code, err = _run_main("ds_train", ["--enable_amp", "True"], capsys)
    assert "unknown option --enable_amp: precision is set by the DeepSpeed JSON" in err and "ds_fp16.json" in err
    code, err = _run_main("model.predict", ["--input", "x.h5", "--overlapp", "4"], capsys)
    assert code == 2 and "unknown option --overlapp (did you mean --overlap?)" in err


def test_help_shows_defaults_and_the_named_configs(capsys):
    from ds_train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    flat = " ".join(out.split())
    assert "--num_epochs VALUE training epochs (default: 10; debug: 5)" in flat  # debug: the config run by default
    assert "--lambda_rho VALUE weight of the extra L1 term on gas density in original space (default: 0.0) " in flat
    assert "(default: {scaling: sqrt, start_lr: 0.0002, end_lr: 0.0, warmup_steps: 128}; debug: {scaling: none," in flat
    assert "--synthetic VALUE" in flat and "(default: null)" in flat
    named = named_configs(REPO / "ds_configs" / "UNet.yaml")
    assert {"base", "short", "bs64_opt", "debug"} <= {name for name, _ in named}
    for name, description in named:
        assert description, f"config {name} has no description"
        assert re.search(rf"^  {re.escape(name)} +{re.escape(description)}$", out, re.M), name
    assert len({d for _, d in named}) == len(named), "descriptions inherited through YAML anchors"


def test_help_lists_the_configs_of_another_yaml_file(tmp_path, capsys):
    mine = tmp_path / "mine.yaml"
    mine.write_text("tiny:\n  description: my own config\n  num_epochs: 1\n")
    from ds_train import main

    with pytest.raises(SystemExit):
        main(["--yaml_config", str(mine), "--help"])
    out = capsys.readouterr().out
    assert f"named configs in {mine}" in out and re.search(r"^  tiny +my own config$", out, re.M)
    with pytest.raises(SystemExit):
        main(["--yaml_config", str(mine), "--config", "tiny", "--help"])
    assert "(default: 10; tiny: 1)" in " ".join(capsys.readouterr().out.split())


@pytest.fixture
def kinds(tmp_path):
    """A file and a directory, for giving each where the other is needed."""
    (tmp_path / "a_file").write_text("x\n")
    (tmp_path / "a_dir").mkdir()
    return {
        "file": str(tmp_path / "a_file"),
        "dir": str(tmp_path / "a_dir"),
        "under_file": str(tmp_path / "a_file" / "x"),
    }


WRONG_KINDS = [
    ("ds_train", ["--run_dir", "{file}"], "is a file, not a directory"),
    ("ds_train", ["--run_dir", "{under_file}"], "a_file is a file, not a directory"),
    ("ds_train", ["--yaml_config", "{dir}"], "is a directory, not a file"),
    ("model.predict", ["--input", "{dir}"], "is a directory, not a file"),
    ("model.predict", ["--input", "{file}", "--out", "{file}"], "is a file, not a directory"),
    ("model.predict", ["--input", "{file}", "--run_dir", "{file}"], "is a file, not a directory"),
    ("model.predict", ["--input", "{file}", "--weights", "{dir}"], "is a directory, not a file"),
    ("model.predict", ["--input", "{file}", "--weights", "{dir}/none.pt"], "no such file"),
    ("model.predict", ["--input", "{file}", "--truth", "{dir}"], "is a directory, not a file"),
    ("model.export", ["--out", "{dir}"], "is a directory; name the file to write"),
    ("model.export", ["--out", "{under_file}"], "a_file is a file, not a directory"),
    ("model.export", ["--out", "x.pt", "--run_dir", "{file}"], "is a file, not a directory"),
    ("pipeline.convert", ["{dir}", "--out_prefix", "p"], "is a directory, not a file"),
    ("pipeline.convert", ["{file}", "--out_prefix", "{dir}"], "is a directory; name the file to write"),
    ("pipeline.synthetic", ["--out_dir", "{file}"], "is a file, not a directory"),
    ("trainer.hostfile", ["{dir}"], "is a directory, not a file"),
    ("bench.train", ["--out", "{dir}"], "is a directory; name the file to write"),
    ("bench.sweep", ["--out", "{dir}"], "is a directory; name the file to write"),
    ("bench.pipeline", ["--data", "{dir}"], "is a directory; name the file to write"),
    ("bench.pipeline", ["--report", "--doc", "{dir}"], "is a directory, not a file"),
    ("bench.report", ["--results", "{dir}"], "is a directory, not a file"),
    ("bench.report", ["--plots", "{file}"], "is a file, not a directory"),
    ("bench.soak", ["--report", "{file}"], "is a file, not a directory"),
]


@pytest.mark.parametrize("command, argv, message", WRONG_KINDS, ids=[f"{c} {' '.join(a)}" for c, a, _ in WRONG_KINDS])
def test_a_path_of_the_wrong_kind_is_one_line(command, argv, message, kinds, capsys):
    code, err = _run_main(command, [a.format(**kinds) for a in argv], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_config_paths_of_the_wrong_kind_are_one_line(tmp_path):
    (tmp_path / "a_file").write_text("x\n")
    for key, value, message in [
        ("train_path", tmp_path, f"train_path {tmp_path} is a directory, not a file"),
        ("deepspeed_config", tmp_path, "is a directory, not a file"),
        ("val_path", tmp_path / "a_file" / "val.h5", "a_file is a file, not a directory"),
    ]:
        result = run_train(["--config", "debug", "--run_dir", str(tmp_path / key), f"--{key}", str(value)])
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
        assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-2000:]
        # Chosen explicitly, DeepSpeed's accelerator detection does not warn on every start.
        assert "unable to detect it" not in result.stderr + result.stdout


# --- installing torch: the CPU build where there is no GPU, the default index where the CPU one is unreachable ---


def _pin() -> str:
    return next(line for line in (REPO / "requirements.txt").read_text().splitlines() if line.startswith("torch=="))


def _install_torch(env: dict[str, str]) -> subprocess.CompletedProcess:
    """tools/install_torch.py with this venv's python: the pinned torch is installed, so pip changes nothing."""
    return subprocess.run(
        [sys.executable, "tools/install_torch.py", _pin()],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


needs_no_gpu = pytest.mark.skipif(
    importlib.import_module("torch").cuda.is_available(), reason="the CPU-build choice is made only without a GPU"
)


@needs_no_gpu
def test_install_falls_back_to_the_default_index_when_the_cpu_index_is_unreachable():
    result = _install_torch({"TORCH_CPU_INDEX": "http://127.0.0.1:9/whl/cpu", "TORCH_INDEX": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    chosen = [line for line in result.stdout.splitlines() if line.startswith("torch:")]
    assert len(chosen) == 1, result.stdout
    assert "no NVIDIA GPU, and http://127.0.0.1:9/whl/cpu cannot be used" in chosen[0]
    assert chosen[0].endswith("from the default index")


@needs_no_gpu
def test_install_takes_the_cpu_index_when_it_answers(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<html></html>")
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_port}/"
        result = _install_torch({"TORCH_CPU_INDEX": index, "TORCH_INDEX": ""})
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr[-2000:]
    chosen = [line for line in result.stdout.splitlines() if line.startswith("torch:")]
    assert chosen == [f"torch: no NVIDIA GPU: installing the CPU build of {_pin()} from {index}"]


# --- TensorBoard, as the README starts it ---------------------------------------------------------------------


def test_make_tensorboard_serves_the_runs(tmp_path):
    if not (REPO / ".venv" / ".installed").exists():
        pytest.skip("make tensorboard needs the project's .venv (make setup)")
    proc = subprocess.Popen(
        ["make", "-s", "tensorboard", f"RUNS={tmp_path}", "PORT=0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = re.search(r"TensorBoard \S+ at (http://\S+)", line)
            url = match.group(1) if match else None
        assert url is not None, "".join(lines)
        with urllib.request.urlopen(url + "data/logdir", timeout=30) as response:
            assert str(tmp_path) in response.read().decode()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_the_one_off_build_of_deepspeeds_cpu_op_is_announced_only_when_it_will_happen(monkeypatch, tmp_path, caplog):
    from trainer.dist import announce_cpu_comm_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level("INFO", logger="trainer.dist"):
        announce_cpu_comm_build()
    assert caplog.messages == [
        f"building DeepSpeed's CPU communication op, once (about 40 s; cached in {tmp_path / 'deepspeed_shm_comm'})"
    ]
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level("INFO", logger="trainer.dist"):
        announce_cpu_comm_build()
    assert caplog.messages == []
