"""Install the pinned torch into a virtual environment: the CUDA build where an NVIDIA GPU is present, the CPU build
elsewhere, so that a laptop is not sent several GB of CUDA libraries it cannot use.

    python tools/install_torch.py torch==2.13.0               # with the venv's python (make does this)

Where no NVIDIA GPU is found, PyTorch's CPU wheel index is used; if it cannot be reached (a proxy, a mirror-only
site), the default index is used instead. One line says which was chosen and why. TORCH_INDEX
names an index to use whatever the machine has; TORCH_CPU_INDEX moves the CPU index (a local mirror).
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def nvidia_gpu() -> bool:
    """An NVIDIA driver with at least one GPU: nvidia-smi lists one, or the driver's device files are there."""
    if shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            return listed.returncode == 0 and "GPU" in listed.stdout
        except (OSError, subprocess.TimeoutExpired):
            pass
    return Path("/dev/nvidia0").exists()


def reachable(index: str, timeout_s: float = 10.0) -> str | None:
    """None if the index answers for torch, else why not."""
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        return str(getattr(err, "reason", err))


def pip_install(requirement: str, index: str | None) -> int:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", requirement]
    return subprocess.run(cmd + (["--index-url", index] if index else [])).returncode


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/install_torch.py torch==VERSION", file=sys.stderr)
        return 2
    requirement = argv[0]
    if os.environ.get("TORCH_INDEX"):
        print(f"torch: installing {requirement} from TORCH_INDEX={os.environ['TORCH_INDEX']}", flush=True)
        return pip_install(requirement, os.environ["TORCH_INDEX"])
    if nvidia_gpu():
        print(f"torch: NVIDIA GPU found: installing {requirement} from the default index (the CUDA build)", flush=True)
        return pip_install(requirement, None)
    cpu_index = os.environ.get("TORCH_CPU_INDEX", CPU_INDEX)
    problem = reachable(cpu_index)
    if problem is None:
        print(f"torch: no NVIDIA GPU: installing the CPU build of {requirement} from {cpu_index}", flush=True)
        return pip_install(requirement, cpu_index)  # a failure there is pip's to report: no CUDA build instead
    print(
        f"torch: no NVIDIA GPU, and {cpu_index} cannot be used ({problem}): installing {requirement} from the "
        "default index",
        flush=True,
    )
    return pip_install(requirement, None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
