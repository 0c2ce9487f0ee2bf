"""The fast paths are switches on the same code, each pinned to the plain path here."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from model import Loss, UNet
from pipeline.crops import CropBatcher
from pipeline.loaders import LoaderSettings, build_loader, dali_installed
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.storage import to_device
from pipeline.volumes import VolumeFiles, VolumePair
from tests.conftest import REPO, EveryRotation, run_train, single_process_env, tiny_args

CROP = 8
AUG = Augmenter(in_channels=4, out_channels=5, in_vectors=[[1, 2, 3]], out_vectors=[[1, 2, 3]])
CPU = torch.device("cpu")
BACKENDS = ["torch"] + (["dali"] if dali_installed() else [])
CHANNELS_LAST = torch.channels_last_3d


@pytest.fixture(scope="module")
def volumes(tiny_data):
    return VolumePair.open(VolumeFiles.hdf5(tiny_data["train"]), 4, 5, crop_size=CROP).load()


def _epoch(loader):
    return [
        (inputs.clone(memory_format=torch.preserve_format), targets.clone(memory_format=torch.preserve_format))
        for inputs, targets in loader
    ]


PLAN = EveryRotation(seed=0, num_samples=28, batch_size=8, box_size=32, crop_size=CROP, rotate=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_channels_last_batches_hold_the_same_values(volumes, backend):
    def batches(channels_last):
        settings = LoaderSettings(
            backend=backend,
            storage="host",
            device_storage_dtype="float32",
            threads=2,
            lookahead=2,
            channels_last=channels_last,
        )
        return _epoch(build_loader(volumes, PLAN, AUG, settings=settings, device=CPU, dtype=torch.float32))

    for (a_inp, a_tar), (b_inp, b_tar) in zip(batches(False), batches(True), strict=True):
        assert b_inp.is_contiguous(memory_format=CHANNELS_LAST) and b_tar.is_contiguous(memory_format=CHANNELS_LAST)
        assert a_inp.is_contiguous() and torch.equal(a_inp, b_inp) and torch.equal(a_tar, b_tar)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", ["batcher", "resident"])
@pytest.mark.parametrize("rotate", [True, False], ids=["training", "validation"])
def test_channels_last_on_the_device_paths(volumes, backend, source, rotate):
    """Where the device rotates (run here on the CPU), it also moves the channels last, unrotated batches too."""
    plan = PLAN if rotate else DrawPlan(seed=0, num_samples=20, batch_size=8, box_size=32, crop_size=CROP, rotate=False)
    outputs = {}
    for channels_last in (False, True):
        common = dict(plan=plan, augmenter=AUG, dtype=torch.float32, channels_last=channels_last)
        resident = to_device(volumes, CPU, "float32")
        if backend == "dali":
            from pipeline.dali import BatcherCrops, DaliLoader, ResidentCrops

            if source == "batcher":
                crops = BatcherCrops(CropBatcher(volumes, plan, AUG, rotate_here=False, threads=1, lookahead=1, hold=2))
            else:
                crops = ResidentCrops(
                    *resident, AUG, crop_size=plan.crop_size, dtype=torch.float32, channels_last=channels_last
                )
            loader = DaliLoader(crops=crops, device_id=None, **common)
        else:
            from pipeline.torch_backend import TorchLoader

            if source == "batcher":
                feed = dict(batcher=CropBatcher(volumes, plan, AUG, rotate_here=False, threads=1, lookahead=1, hold=1))
            else:
                feed = dict(resident=resident)
            loader = TorchLoader(device=CPU, rotate_on_device=True, **feed, **common)
        outputs[channels_last] = _epoch(loader)
    for (a_inp, a_tar), (b_inp, b_tar) in zip(outputs[False], outputs[True], strict=True):
        assert (
            b_inp.is_contiguous(memory_format=CHANNELS_LAST) and torch.equal(a_inp, b_inp) and torch.equal(a_tar, b_tar)
        )


def test_channels_last_gradients_match_the_plain_path():
    torch.manual_seed(0)
    net = UNet(4, 5, width=8, depth=3)
    net.init_weights(conv_scale=0.1, conv_bias=0.0)
    x, y = torch.randn(2, 4, 16, 16, 16), torch.rand(2, 5, 16, 16, 16) - 0.5
    grads = []
    for inputs in (x, x.contiguous(memory_format=CHANNELS_LAST)):
        net.zero_grad()
        out = net(inputs)
        Loss()(out, y).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        if inputs.is_contiguous(memory_format=CHANNELS_LAST):
            assert out.is_contiguous(memory_format=CHANNELS_LAST)  # the format carries through the network
    for plain, fast in zip(*grads, strict=True):
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-7)


def _final_val_loss(tmp_path, name, *extra):
    """The tiny run's final validation loss, with a U-Net of depth 2 (torch.compile's first build is the cost)."""
    data = tmp_path.parent / "fast-data"
    args = tiny_args(data / "train.h5", data / "val.h5", tmp_path / name, "--num_epochs", "1", "--unet_depth", "2")
    result = run_train([*args, *extra])
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((tmp_path / name / "summary.json").read_text())["final_val_loss"]


def test_training_with_the_fast_paths_matches_the_plain_path(tmp_path):
    plain = _final_val_loss(tmp_path, "plain")
    assert _final_val_loss(tmp_path, "channels_last", "--channels_last", "true") == pytest.approx(plain, rel=1e-5)
    assert _final_val_loss(tmp_path, "compiled", "--compile", "true") == pytest.approx(plain, rel=1e-5)
    assert _final_val_loss(tmp_path, "padded", "--pad_last_layer", "true") == pytest.approx(plain, rel=1e-5)


def test_switches_warn_where_they_cannot_work(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the warning is for machines without a GPU")
    data = tmp_path / "data"
    result = run_train(
        tiny_args(
            data / "train.h5",
            data / "val.h5",
            tmp_path / "run",
            "--num_epochs",
            "1",
            "--cudnn_benchmark",
            "true",
            "--cudnn_benchmark_limit",
            "0",
            "--science_box_size",
            "16",
            "--storage",
            "host",
            "--device_storage_dtype",
            "float16",
            "--compile_mode",
            "reduce-overhead",
        )
    )
    assert result.returncode == 0 and "cudnn_benchmark has no effect without a GPU" in result.stderr
    assert "cudnn_benchmark_limit has no effect without a GPU" in result.stderr
    assert "science_box_size has no effect without science_every_epochs" in result.stderr
    assert "device_storage_dtype has no effect with storage 'host'" in result.stderr
    assert "compile_mode has no effect without compile: true" in result.stderr
    assert "num_data_workers" not in result.stderr  # the host storage's threads do cut the crops


@pytest.mark.parametrize(
    "benchmark, limit, expected, warning",
    [
        (None, None, (True, 7), None),  # a GPU's default: autotuning, the limit left as it was
        (None, 0, (True, 0), None),
        (True, 3, (True, 3), None),
        (False, 0, (False, 7), "cudnn_benchmark_limit has no effect with cudnn_benchmark: false"),
    ],
)
def test_cudnn_autotuning_on_a_gpu_is_set_as_the_config_asks(benchmark, limit, expected, warning, caplog):
    """torch's cuDNN flags are process-wide and settable without a GPU: build_engine's setting of them for a GPU,
    from autotuning off and a limit of 7."""
    from trainer.build import set_cudnn
    from trainer.config import Config

    before = torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit
    try:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = False, 7
        set_cudnn(Config(cudnn_benchmark=benchmark, cudnn_benchmark_limit=limit), "cuda")
        got = torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = before
    assert got == expected
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == ([warning] if warning else [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_training_step_does_not_synchronize_the_gpu(monkeypatch):
    """The engine's step (forward, backward, FusedAdam) in fp32 with nonfinite_loss: ignore queues its work
    without waiting on the GPU. (fp16 and bf16 read an overflow flag on the host, by DeepSpeed's design.)
    The sync debug mode does not see explicit torch.cuda.synchronize() calls: those fail the test too."""
    deepspeed = pytest.importorskip("deepspeed")

    from trainer.dist import DistEnv, init_distributed
    from trainer.engine import BatchPlan, load_ds_template, resolve_ds_config, skip_single_rank_reduction
    from trainer.step import train_step

    init_distributed(DistEnv.from_environ({}), 60.0)
    config = resolve_ds_config(
        load_ds_template(REPO / "ds_configs" / "ds_fp32.json"), BatchPlan(4, 1, 1), 1e-3, device_type="cuda"
    )
    net = UNet(4, 5, width=8, depth=4)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    skip_single_rank_reduction(engine)
    x = torch.randn(4, 4, 32, 32, 32, device=engine.device).contiguous(memory_format=CHANNELS_LAST)
    y = torch.rand(4, 5, 32, 32, 32, device=engine.device) - 0.5
    for _ in range(2):  # warm-up: first calls set things up
        train_step(engine, iter([(x, y)]), loss_fn=Loss())
    torch.cuda.synchronize()

    def no_sync(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize() inside the training step")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        (loss,) = train_step(engine, iter([(x, y)]), loss_fn=Loss()).losses
    finally:
        torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    assert np.isfinite(loss.item())


SINGLE_RANK_STEPS = """
import torch, deepspeed
from model import Loss, UNet
from tests.conftest import REPO
from trainer.dist import DistEnv
from trainer.engine import BatchPlan, load_ds_template, resolve_ds_config, skip_single_rank_reduction
from trainer.step import train_step
from trainer.dist import init_distributed

device = init_distributed(DistEnv.from_environ(), 60.0)
template = load_ds_template(REPO / "ds_configs" / "ds_fp32.json")
config = resolve_ds_config(template, BatchPlan(2, 2, 1), 1e-3, device_type=device.type)
engines = []
for skip in (False, True):
    torch.manual_seed(0)
    net = UNet(4, 5, width=4, depth=2)
    initial = [p.detach().clone() for p in net.parameters()]
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    assert skip_single_rank_reduction(engine) if skip else engine.enable_backward_allreduce
    engines.append(engine)
gen = torch.Generator().manual_seed(1)
for _ in range(2):  # two optimizer steps of two micro-batches
    batches = [(torch.randn(2, 4, 8, 8, 8, generator=gen), torch.rand(2, 5, 8, 8, 8, generator=gen) - 0.5)
               for _ in range(2)]
    for engine in engines:
        on_device = [(x.to(engine.device), y.to(engine.device)) for x, y in batches]
        train_step(engine, iter(on_device), loss_fn=Loss(lambda_rho=0.1))
assert engines[1].global_steps == 2 and not engines[1].enable_backward_allreduce
reduced, skipped = ([p.detach().cpu() for p in engine.module.parameters()] for engine in engines)
assert not all(torch.equal(p, q) for p, q in zip(reduced, initial)), "the weights did not move"
assert all(torch.equal(p, q) for p, q in zip(reduced, skipped, strict=True)), "skipping the reduction changed them"
print("same weights")
"""


def _run_one_rank(script):
    command = [sys.executable, "-c", script]
    return subprocess.run(command, cwd=REPO, env=single_process_env(), capture_output=True, text=True, timeout=300)


def test_one_rank_skips_the_gradient_reduction_and_trains_the_same():
    """DeepSpeed all-reduces gradients even over one rank; skipping that identity leaves every weight bit-equal."""
    result = _run_one_rank(SINGLE_RANK_STEPS)
    assert result.returncode == 0 and "same weights" in result.stdout, result.stderr[-2000:]


COUNTED_SYNCS = """
import torch, deepspeed
from deepspeed.accelerator import get_accelerator
from model import Loss, UNet
from tests.conftest import REPO
from trainer.dist import DistEnv
from trainer.engine import BatchPlan, load_ds_template, resolve_ds_config, skip_single_rank_reduction
from trainer.step import train_step
from trainer.dist import init_distributed

device = init_distributed(DistEnv.from_environ(), 60.0)
template = load_ds_template(REPO / "ds_configs" / "ds_fp32.json")
config = resolve_ds_config(template, BatchPlan(2, 1, 1), 1e-3, device_type=device.type)
net = UNet(4, 5, width=4, depth=2)
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
skip_single_rank_reduction(engine)
accelerator, syncs = get_accelerator(), []
accelerator.synchronize = lambda *args, **kwargs: syncs.append(1)
x, y = torch.randn(2, 4, 8, 8, 8), torch.rand(2, 5, 8, 8, 8) - 0.5
for _ in range(5):
    train_step(engine, iter([(x.to(engine.device), y.to(engine.device))]), loss_fn=Loss(lambda_rho=0.1))
print("device syncs in 5 steps:", len(syncs))
"""


def test_engine_steps_do_not_synchronize_the_device():
    """DeepSpeed's throughput timer, on by default, synchronizes the device at every forward and optimizer
    step (the host then cannot queue work ahead); ours is off. Counted through the accelerator, on any device."""
    result = _run_one_rank(COUNTED_SYNCS)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "device syncs in 5 steps: 0" in result.stdout, result.stdout


def _training_losses(tmp_path, name, *extra):
    """Every logged training loss of a 2-epoch run of the tiny config, fp32, one log point per optimizer step."""
    data = tmp_path.parent / "fast-data"
    result = run_train(
        tiny_args(
            data / "train.h5",
            data / "val.h5",
            tmp_path / name,
            "--num_epochs",
            "2",
            "--log_every_steps",
            "1",
            "--deepspeed_config",
            "ds_configs/ds_fp32.json",
            "--cudnn_benchmark",
            "false",
            *extra,
        )
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss/train"] for r in records if "loss/train" in r]


@pytest.mark.skipif(not torch.cuda.is_available() or not dali_installed(), reason="needs a GPU and DALI")
def test_gpu_dali_batches_handed_to_torch_are_not_reused_while_it_reads_them(tmp_path):
    """DALI's external source reads the batcher's ring of buffers without a copy (no_copy), and the iterator hands
    its GPU outputs on; were a buffer cut into again while DALI still read it, or an output reused while the step
    still read it, the losses would drift from the torch backend's. Without the per-step sync of the non-finite check
    (nonfinite_loss: ignore) and with the shortest lookahead, nothing holds the host back."""
    fast = ["--nonfinite_loss", "ignore", "--data_prefetch", "1"]
    dali = _training_losses(tmp_path, "dali", "--backend", "dali", "--storage", "host", *fast)
    torch_backend = _training_losses(tmp_path, "torch", "--backend", "torch", "--storage", "host", *fast)
    assert len(dali) == len(torch_backend) == 32
    assert dali == pytest.approx(torch_backend, rel=1e-4)  # the same samples; only the GPU's summation order differs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_cuda_graphs_with_gradient_accumulation_train_as_the_plain_path(tmp_path):
    """compile_mode reduce-overhead replays CUDA graphs whose outputs the next replay overwrites; with two
    micro-batches per optimizer step, each forward's activations must still be there for its backward."""
    accumulate = ["--micro_batch_size", "4"]  # global batch 8 on one rank: accumulation 2
    plain = _training_losses(tmp_path, "plain", *accumulate)
    graphs = _training_losses(tmp_path, "graphs", *accumulate, "--compile", "true", "--compile_mode", "reduce-overhead")
    assert len(plain) == len(graphs) == 32
    assert graphs == pytest.approx(plain, rel=1e-4)
