import json
import logging
import os
import sys

import pytest

from tests.conftest import REPO
from trainer import engine, fused_adam
from trainer.engine import BatchPlan, load_ds_template, plan_batches, resolve_ds_config
from trainer.errors import ConfigError
from trainer.fused_adam import TORCH_FUSED_ADAM, fused_adam_problem


@pytest.mark.parametrize(
    "global_batch, micro, world, expected",
    [(64, None, 1, (64, 1)), (64, None, 4, (16, 1)), (64, 8, 4, (8, 2)), (2048, 16, 32, (16, 4))],
)
def test_batch_plan(global_batch, micro, world, expected):
    plan = plan_batches(global_batch, micro, world)
    assert (plan.micro_batch, plan.accumulation) == expected
    assert plan.global_batch == global_batch


@pytest.mark.parametrize(
    "global_batch, micro, world, message",
    [
        (64, None, 3, "not divisible by the world size 3"),
        (64, 24, 2, "32 per rank, not a multiple of micro_batch_size 24"),
    ],
)
def test_inconsistent_batches_are_errors(global_batch, micro, world, message):
    with pytest.raises(ConfigError, match=message):
        plan_batches(global_batch, micro, world)


@pytest.fixture
def probe(monkeypatch):
    """Fresh FusedAdam probes (it is cached per process) in an environment the test changes."""
    fused_adam_problem.cache_clear()
    yield fused_adam_problem
    fused_adam_problem.cache_clear()


@pytest.mark.parametrize("problem", [None, "ninja is not on PATH (pip install ninja)"])
@pytest.mark.parametrize("name", ["ds_fp16.json", "ds_bf16.json", "ds_fp32.json"])
def test_shipped_configs_keep_the_recipe(name, problem, monkeypatch):
    monkeypatch.setattr(engine, "fused_adam_problem", lambda: problem)
    cfg = resolve_ds_config(load_ds_template(REPO / "ds_configs" / name), BatchPlan(16, 2, 2), 3e-4, device_type="cuda")
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (
        64,
        16,
        2,
    )
    assert cfg["optimizer"]["type"] == "Adam" and cfg["optimizer"]["params"]["adam_w_mode"] is False
    assert cfg["optimizer"]["params"]["lr"] == 3e-4
    # DeepSpeed's FusedAdam on GPUs, torch's fused Adam where it cannot be built
    if problem is None:
        assert "torch_adam" not in cfg["optimizer"]["params"]
    else:
        assert {k: cfg["optimizer"]["params"][k] for k in TORCH_FUSED_ADAM} == TORCH_FUSED_ADAM
    assert cfg["gradient_clipping"] == 0.0


def test_fp16_on_cpu_becomes_fp32_with_a_warning(caplog, probe):
    template = load_ds_template(REPO / "ds_configs" / "ds_fp16.json")
    with caplog.at_level(logging.WARNING):
        cfg = resolve_ds_config(template, BatchPlan(4, 1, 1), 1e-3, device_type="cpu")
    assert cfg["fp16"]["enabled"] is False and not cfg.get("bf16", {}).get("enabled")
    assert "training in fp32 on cpu" in caplog.text
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert template["fp16"]["enabled"] is True  # the template is not modified
    gpu = resolve_ds_config(template, BatchPlan(4, 1, 1), 1e-3, device_type="cuda")
    assert gpu["fp16"]["enabled"] is True


def test_fused_adam_that_cannot_be_built_gives_way_to_torchs_with_one_warning(monkeypatch, tmp_path, caplog, probe):
    """No ninja anywhere (PATH, or beside the interpreter) and nothing built before: where DeepSpeed's JIT build of
    FusedAdam would fail inside deepspeed.initialize, the config takes torch's fused Adam instead."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.syspath_prepend(str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "ninja", None)  # no ninja package either
    assert probe() == "ninja is not on PATH (pip install ninja)"
    template = load_ds_template(REPO / "ds_configs" / "ds_fp16.json")
    with caplog.at_level(logging.WARNING):
        cfg = resolve_ds_config(template, BatchPlan(4, 1, 1), 1e-3, device_type="cuda")
    assert cfg["optimizer"]["params"]["torch_adam"] is True and cfg["optimizer"]["params"]["fused"] is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "DeepSpeed's FusedAdam cannot be built here (ninja is not on PATH (pip install ninja)): "
        "training with torch's fused Adam"
    ]
    # A build from before counts: the cached extension is loaded, nothing is compiled.
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("FusedAdamBuilder")
    cached = tmp_path / "extensions" / builder.name
    cached.mkdir(parents=True, exist_ok=True)  # looking for it created the directory
    (cached / f"{builder.name}.so").write_bytes(b"")
    probe.cache_clear()
    assert probe() is None
    # A user's explicit choice stands.
    mine = resolve_ds_config(
        {"optimizer": {"type": "Adam", "params": {"torch_adam": False}}}, BatchPlan(4, 1, 1), 1e-3, device_type="cuda"
    )
    assert mine["optimizer"]["params"] == {"torch_adam": False, "lr": 1e-3, "adam_w_mode": False}


@pytest.mark.parametrize("layout", ["venv", "target"])
def test_a_ninja_off_path_is_found_and_put_on_path(layout, monkeypatch, tmp_path, probe):
    """Beside the interpreter (a virtual environment not activated), or in SITE/bin beside the ninja package
    (wheels installed with pip --target SITE, on PYTHONPATH)."""
    site = tmp_path / "site"
    (site / "ninja").mkdir(parents=True)
    (site / "ninja" / "__init__.py").write_text("")
    bin_dir = tmp_path / "venv" / "bin" if layout == "venv" else site / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "ninja").write_text("#!/bin/sh\necho 1.13.2\n")
    (bin_dir / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.delitem(sys.modules, "ninja", raising=False)
    monkeypatch.syspath_prepend(str(site))
    assert probe() != "ninja is not on PATH (pip install ninja)"
    assert os.environ["PATH"].split(os.pathsep)[0] == str(bin_dir)


def test_recipe_defaults_fill_a_minimal_json():
    cfg = resolve_ds_config({}, BatchPlan(4, 1, 1), 1e-3, device_type="cpu")
    assert cfg["optimizer"]["params"]["adam_w_mode"] is False  # plain Adam, as the reference
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed would clip at 1.0


@pytest.mark.parametrize(
    "template, message",
    [
        ({"train_batch_size": 32}, "train_batch_size=32, but the experiment's batch settings give 64"),
        ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps=1, but .* give 2"),
        ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' section"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 0.1}}}, "sets optimizer.params.lr"),
        ({"zero_optimisation": {"stage": 2}}, "is not DeepSpeed's \\(did you mean 'zero_optimization'"),
        ({"fp16": False}, "section 'fp16' must be a mapping, got False"),
    ],
)
def test_conflicting_json_is_an_error(template, message):
    with pytest.raises(ConfigError, match=message):
        resolve_ds_config(template, BatchPlan(16, 2, 2), 1e-3, device_type="cpu")


def test_matching_batch_keys_are_accepted():
    cfg = resolve_ds_config({"train_batch_size": 64}, BatchPlan(16, 2, 2), 1e-3, device_type="cpu")
    assert cfg["train_batch_size"] == 64


def test_unreadable_json(tmp_path):
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_ds_template(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read DeepSpeed config"):
        load_ds_template(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text(json.dumps([1]))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_ds_template(tmp_path / "list.json")


def test_overrides_merge_into_the_json_mapping_by_mapping(tmp_path):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}, "fp16": {"enabled": True}}))
    merged = load_ds_template(path, {"zero_optimization": {"reduce_bucket_size": 200000000}, "fp16": False})
    assert merged["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 200000000}
    assert merged["fp16"] is False
    assert load_ds_template(path) == json.loads(path.read_text())  # the file itself is left alone


def test_overrides_cannot_set_what_the_experiment_sets(tmp_path):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"eps": 1e-8}}}))
    with pytest.raises(ConfigError, match="sets optimizer.params.lr"):
        template = load_ds_template(path, {"optimizer": {"params": {"lr": 0.1}}})
        resolve_ds_config(template, BatchPlan(16, 2, 2), 1e-3, device_type="cpu")


def test_the_throughput_timer_stays_off_unless_the_json_turns_it_on():
    # DeepSpeed's timer synchronizes the device twice a step: off, also where the JSON sets other timer settings.
    partial = resolve_ds_config(
        {"timers": {"throughput": {"synchronized": True}}}, BatchPlan(4, 1, 1), 1e-3, device_type="cuda"
    )
    assert partial["timers"] == {"throughput": {"synchronized": True, "enabled": False}}
    asked = resolve_ds_config(
        {"timers": {"throughput": {"enabled": True}}}, BatchPlan(4, 1, 1), 1e-3, device_type="cuda"
    )
    assert asked["timers"]["throughput"]["enabled"] is True


@pytest.mark.parametrize(
    "value, capability, expected",
    [
        ("9.0a", None, "9.0"),
        ("8.0;9.0a", None, "8.0;9.0"),
        ("7.5 8.0 9.0+PTX", None, "7.5;8.0;9.0+PTX"),
        ("9.0a;10.0f;10.0a", None, "9.0;10.0"),
        ("Hopper", (9, 0), "9.0"),
    ],
)
def test_arch_lists_with_suffixes_become_ones_deepspeed_parses(value, capability, expected, monkeypatch):
    """DeepSpeed 0.19.8's op builder does int() on each entry's minor part: '9.0a' kills its JIT build of FusedAdam
    (a ValueError inside deepspeed.initialize). Its own parsing, run on the CPU, refuses the value and takes the
    fitted one."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA op's: its parsing needs no GPU

    assert fused_adam.parseable_arch_list(value, capability) == expected
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    if any(c.isalpha() for c in value.replace("PTX", "")):
        assert "ValueError: invalid literal for int()" in fused_adam.arch_list_problem(FusedAdamBuilder())
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", expected)
    assert fused_adam.arch_list_problem(FusedAdamBuilder()) is None
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == expected  # DeepSpeed's parsing rewrites it: restored


def test_an_arch_list_is_fitted_once_per_process_and_said_in_one_line(monkeypatch, caplog):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    fused_adam.fit_arch_list.cache_clear()
    with caplog.at_level(logging.INFO):
        assert fused_adam.fit_arch_list() is None
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"
    assert [r.getMessage() for r in caplog.records] == [
        "TORCH_CUDA_ARCH_LIST '8.0;9.0a' set to '8.0;9.0' in this process, which DeepSpeed 0.19.8 can parse"
    ]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopper")  # a named architecture, and no GPU to take it from
    fused_adam.fit_arch_list.cache_clear()
    assert fused_adam.fit_arch_list() == (
        "TORCH_CUDA_ARCH_LIST 'Hopper' has entries DeepSpeed cannot parse, and no GPU is visible"
    )
    fused_adam.fit_arch_list.cache_clear()


def test_an_arch_list_deepspeed_cannot_parse_gives_way_to_torchs_fused_adam(monkeypatch, caplog, probe):
    """Whatever fitting cannot mend, the probe reports (with DeepSpeed's CUDA builder, as on a GPU), and the config
    falls back to torch's fused Adam instead of failing inside deepspeed.initialize."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setattr(get_accelerator(), "create_op_builder", lambda name: FusedAdamBuilder())
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopper")
    fused_adam.fit_arch_list.cache_clear()
    template = load_ds_template(REPO / "ds_configs" / "ds_fp16.json")
    with caplog.at_level(logging.WARNING):
        cfg = resolve_ds_config(template, BatchPlan(4, 1, 1), 1e-3, device_type="cuda")
    fused_adam.fit_arch_list.cache_clear()
    assert {k: cfg["optimizer"]["params"][k] for k in TORCH_FUSED_ADAM} == TORCH_FUSED_ADAM
    assert "TORCH_CUDA_ARCH_LIST 'Hopper' has entries DeepSpeed cannot parse" in caplog.text
