"""What a GPU machine without internet needs, checked on the CPU: the wheels shipped to it cover every requirement
of the project, DeepSpeed, DALI and the tests beyond torch and NumPy, and the preflight names every missing module
at once."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.preflight import listed, pinned
from tests.conftest import REPO

# What bench/offline_wheels.sh assumes the GPU machine has; DALI's image codecs are left out on purpose.
PROVIDED = {"torch", "numpy"}
DALI_CODECS = {
    "nvidia-libnvcomp-cu12",
    "nvidia-nvimgcodec-cu12",
    "nvidia-nvjpeg-cu12",
    "nvidia-nvjpeg2k-cu12",
    "nvidia-nvtiff-cu12",
}


def _closure(roots: set[str]) -> set[str]:
    """Every distribution that ``roots`` require, transitively, on a Linux Python 3.12 (as installed here)."""
    environment = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0", "extra": ""}
    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed here: its requirements cannot be read")
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(canonicalize_name(requirement.name))
    return seen


def _shipped(dali: bool) -> set[str]:
    return {canonicalize_name(distribution) for distribution, _ in listed(dali)}


def test_the_offline_wheels_cover_what_the_project_deepspeed_and_the_tests_require():
    given = _closure(PROVIDED)
    project = {
        line.split("==")[0]
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    } - {"nvidia-dali-cuda120", "matplotlib", "colossus"}
    needed = _closure(project | {"pytest"}) - given
    assert needed - _shipped(dali=False) == set()
    # pydantic needs a newer typing-extensions than torch images tend to carry: shipped although torch brings one
    assert "typing-extensions" in _shipped(dali=False)
    dali_needed = _closure({"nvidia-dali-cuda120"}) - given - needed - DALI_CODECS
    assert dali_needed - _shipped(dali=True) == set()
    assert all(pinned(d) for d, _ in listed(dali=True) if d != "nvidia-dali-cuda120"), "every shipped package is pinned"


def test_offline_wheels_ships_the_list(tmp_path):
    """The script asks pip for exactly the listed packages, at their pins (pip itself is echoed here)."""
    result = subprocess.run(
        ["bash", "bench/offline_wheels.sh", str(tmp_path / "wheels"), "3.12"],
        cwd=REPO,
        env={**os.environ, "PIP": "echo"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    asked = {word.split("==")[0].lower() for word in result.stdout.split() if "==" in word}
    assert asked == {d.lower() for d, _ in listed(dali=False)}


PREFLIGHT_WITHOUT = """
import sys
for module in sys.argv[1:]:
    sys.modules[module] = None  # importing it now fails, as on a machine without it
from bench.preflight import main
sys.exit(main([]))
"""


def test_preflight_names_every_missing_module_at_once():
    result = subprocess.run(
        [sys.executable, "-c", PREFLIGHT_WITHOUT, "einops", "msgpack", "yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "einops (pip: einops)" in lines[0] and "msgpack (pip: msgpack)" in lines[0]
    assert "yaml (pip: PyYAML)" in lines[0] and "deepspeed" not in lines[0]
    clean = subprocess.run([sys.executable, "-m", "bench.preflight"], cwd=REPO, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr


@pytest.mark.parametrize("version, refused", [("4.5.0", True), ("4.16.0", False)])
def test_preflight_refuses_a_package_too_old_to_work_and_names_ones_older_than_their_pins(tmp_path, version, refused):
    """typing-extensions older than pydantic needs is the classic: importable, and wrong."""
    old = tmp_path / f"typing_extensions-{version}.dist-info"
    old.mkdir()
    (old / "METADATA").write_text(f"Metadata-Version: 2.1\nName: typing_extensions\nVersion: {version}\n")
    (tmp_path / "typing_extensions.py").write_text("")
    grpc = tmp_path / "grpcio-1.0.0.dist-info"  # older than its pin, and harmless
    grpc.mkdir()
    (grpc / "METADATA").write_text("Metadata-Version: 2.1\nName: grpcio\nVersion: 1.0.0\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    result = subprocess.run(
        [sys.executable, "-m", "bench.preflight"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == (2 if refused else 0), result.stderr
    assert ("typing_extensions 4.5.0 is older than the 4.16 the project needs" in result.stderr) is refused
    assert "grpcio 1.0.0 (pinned: 1.85.3)" in result.stdout


def test_preflight_command_line_errors_are_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "bench.preflight", "--dail"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "python -m bench.preflight: error: unrecognized arguments: --dail"
    ]
