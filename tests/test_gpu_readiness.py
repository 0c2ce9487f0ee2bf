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

from tests.conftest import REPO
from tools.preflight import listed, pinned

# What tools/offline_wheels.sh assumes the GPU machine has; DALI's image codecs are left out on purpose.
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
    return {canonicalize_name(distribution) for distribution, _ in listed(dali=dali)}


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
        ["bash", "tools/offline_wheels.sh", str(tmp_path / "wheels"), "3.12"],
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
from tools.preflight import main
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
    clean = subprocess.run([sys.executable, "-m", "tools.preflight"], cwd=REPO, capture_output=True, text=True)
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
        [sys.executable, "-m", "tools.preflight"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == (2 if refused else 0), result.stderr
    assert ("typing_extensions 4.5.0 is older than the 4.16 the project needs" in result.stderr) is refused
    assert "grpcio 1.0.0 (pinned: 1.85.3)" in result.stdout


def test_preflight_command_line_errors_are_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "tools.preflight", "--dail"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "python -m tools.preflight: error: unrecognized arguments: --dail"
    ]


FAKE_PIP = """
import os, sys, zipfile
args = sys.argv[1:]
if args[0] == "download" and any(a.startswith("nvidia-dali-") for a in args):
    dest = args[args.index("--dest") + 1]
    name = next(a for a in args if a.startswith("nvidia-dali-")).split("==")[0].replace("-", "_")
    with zipfile.ZipFile(os.path.join(dest, f"{name}-2.4.0-py3-none-manylinux_2_28_x86_64.whl"), "w") as wheel:
        wheel.writestr("nvidia/dali/__init__.py", "")
        for tag in ("310", "311", "312", "313t"):  # one compiled module per CPython, 3 MB that do not compress
            wheel.writestr(f"nvidia/dali/backend_impl.cpython-{tag}-x86_64-linux-gnu.so", os.urandom(3 << 20))
print(*args)
"""


def test_dali_for_the_gpu_machines_cuda_repacked_for_its_python_split_and_installed(tmp_path):
    """offline_wheels.sh fetches the DALI build for the CUDA major asked (pip stands in for the registry, writing a
    wheel with a compiled module per CPython), keeps Python 3.12's module only, splits it into parts of 1 MiB;
    install_dali_parts.sh joins, checks and extracts them, and refuses a damaged part in one line."""
    fake_pip = tmp_path / "pip.py"
    fake_pip.write_text(FAKE_PIP)
    env = {**os.environ, "PIP": f"{sys.executable} {fake_pip}", "WITH_DALI": "1", "REPACK": "1", "PART_MIB": "1"}
    wheels = tmp_path / "wheels"
    made = subprocess.run(
        ["bash", "tools/offline_wheels.sh", str(wheels), "3.12", "13"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    assert "nvidia-dali-cuda130==2.4.0" in made.stdout and "cuda120" not in made.stdout
    parts = sorted(p.name for p in (tmp_path / "wheels-dali").glob("*.part*"))
    archive = "nvidia_dali_cuda130-2.4.0-py3-none-manylinux_2_28_x86_64.cp312.tar.xz"
    assert len(parts) == 4 and all(p.startswith(archive + ".part") for p in parts), parts

    def install(site):
        command = ["bash", "tools/install_dali_parts.sh", str(tmp_path / "wheels-dali"), str(site)]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)

    done = install(tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    modules = sorted(p.name for p in (tmp_path / "site" / "nvidia" / "dali").iterdir())
    assert modules == ["__init__.py", "backend_impl.cpython-312-x86_64-linux-gnu.so"]
    (tmp_path / "wheels-dali" / parts[1]).unlink()
    refused = install(tmp_path / "site2")
    assert refused.returncode == 1 and not (tmp_path / "site2").exists()
    assert refused.stdout.splitlines() == [
        f"DALI's parts in {tmp_path / 'wheels-dali'} are incomplete or damaged (3 part(s) of {archive}): DALI skipped"
    ]


def test_offline_wheels_refuses_a_cuda_major_it_has_no_dali_for(tmp_path):
    result = subprocess.run(
        ["bash", "tools/offline_wheels.sh", str(tmp_path / "w"), "3.12", "11"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "offline_wheels.sh: CUDA_MAJOR is 12 or 13 (torch.version.cuda on the GPU machine), not '11'"
    )


def test_a_wheel_without_a_module_for_the_python_asked_is_not_repacked(tmp_path):
    import zipfile

    wheel = tmp_path / "nvidia_dali_cuda130-2.4.0-py3-none-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("nvidia/dali/backend_impl.cpython-311-x86_64-linux-gnu.so", b"")
    command = [sys.executable, "-m", "tools.repack_wheel", str(wheel), "3.12", str(tmp_path / "out.tar.xz")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and not (tmp_path / "out.tar.xz").exists()
    assert result.stderr.strip() == (
        f"python -m tools.repack_wheel: cannot repack {wheel}: {wheel.name} has no compiled module for Python 3.12"
    )
