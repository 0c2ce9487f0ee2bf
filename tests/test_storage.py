"""storage: auto chooses by what fits, from figures given here; the training's memory estimate it weighs, held
against a peak measured on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from model.memory import saved_activation_bytes, training_bytes
from model.unet import UNetSpec
from pipeline.storage import DEVICE, HOST, LAZY, choose_storage
from tests.conftest import REPO

GIB = 2**30


def _choose(**figures):
    base = dict(volume_bytes=36 * GIB, on_gpu=32 * GIB, gpu_free=79 * GIB, training=6 * GIB, buffer_bytes=GIB)
    return choose_storage(**{**base, "host_available": 240 * GIB, "local_ranks": 4, **figures})


def test_auto_takes_the_gpu_then_the_node_then_the_files():
    mode, why = _choose()
    assert (
        mode is DEVICE
        and why == "the volumes (32.00 GiB) and the training (about 6.00 GiB) fit in the GPU's 79.00 GiB free"
    )
    mode, why = _choose(gpu_free=39 * GIB)  # an A100 40 GB: 38 of 39 would leave less than a tenth free
    assert mode is HOST and why.startswith(
        "the volumes (32.00 GiB) and the training (about 6.00 GiB) need 38.00 GiB of"
    )
    assert why.endswith(
        "one copy per node and the batch buffers (40.00 GiB) fit in the 240.00 GiB of host memory available"
    )
    mode, why = _choose(gpu_free=39 * GIB, host_available=40 * GIB)
    assert mode is LAZY and why.endswith("need more than the 40.00 GiB of host memory available")
    assert _choose(on_gpu=None, gpu_free=None)[0] is HOST  # a CPU
    assert _choose(on_gpu=None, gpu_free=None, host_available=None)[0] is HOST  # memory unknown: as before


def test_the_reference_models_estimate():
    reference = UNetSpec(in_channels=4, out_channels=5, width=64, depth=6)
    assert saved_activation_bytes(reference, crop=64, precision="fp16") == pytest.approx(31.1 * 2**20, rel=0.01)
    estimate = training_bytes(reference, crop=64, micro_batch=64, precision="fp16")
    assert 5.5 * GIB < estimate < 7 * GIB  # 6-7 GiB measured at the peak on an H200 (docs/data.md)


STEP = """
import json, sys, torch
from model import Loss
from model.unet import UNetSpec
torch.set_num_threads(1)
batch = int(sys.argv[1])
model = UNetSpec(in_channels=4, out_channels=5, width=16, depth=5).build()
optimizer = torch.optim.Adam(model.parameters())
x, y = torch.randn(batch, 4, 32, 32, 32), torch.rand(batch, 5, 32, 32, 32)
def rss(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
Loss()(model(x[:1]), y[:1]).backward(); optimizer.step(); optimizer.zero_grad()  # Adam's state, allocated
steady = rss("VmRSS:")
Loss()(model(x), y).backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
print(json.dumps({"peak": rss("VmHWM:") - steady}))
"""


def test_the_activation_estimate_bounds_the_peak_measured_on_the_cpu():
    """The peak of a step grows per sample by about what the estimate says (the activations, and the gradients that
    flow back beside them): at most the estimate, more than the activations alone."""
    peaks = {}
    for batch in (8, 24):
        out = subprocess.run(
            [sys.executable, "-c", STEP, str(batch)], cwd=REPO, capture_output=True, text=True, check=True
        )
        peaks[batch] = json.loads(out.stdout)["peak"]
    per_sample = (peaks[24] - peaks[8]) / 16
    saved = saved_activation_bytes(
        UNetSpec(in_channels=4, out_channels=5, width=16, depth=5), crop=32, precision="fp32"
    )
    assert saved < per_sample < 1.1 * 2 * saved, (per_sample / saved, peaks)
