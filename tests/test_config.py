import json
import shutil

import h5py
import pytest

from ds_train import parse_args
from tests.conftest import REPO, run_train, tiny_args
from trainer.build import build_loss
from trainer.config import Config, build_config, changes_on_resume, leaf_keys, load_named, to_dict
from trainer.errors import ConfigError

YAML = REPO / "ds_configs" / "UNet.yaml"


def _load(name, **overrides):
    return build_config(load_named(YAML, name), {k: str(v) for k, v in overrides.items()})


@pytest.mark.parametrize(
    "name, nsamples, nval, epochs, batch, amp",
    [
        ("base", 65536, 8192, 10, 64, False),
        ("short", 4096, 512, 4, 64, False),
        ("short_opt", 4096, 512, 4, 64, True),
        ("bs64_opt", 65536, 8192, 10, 64, True),
        ("bs256_opt", 65536, 8192, 20, 256, True),
        ("bs512_opt", 65536, 8192, 40, 512, True),
        ("bs2048_opt", 65536, 8192, 160, 2048, True),
    ],
)
def test_reference_configs_keep_the_recipe(name, nsamples, nval, epochs, batch, amp):
    cfg = _load(name)
    assert (cfg.Nsamples, cfg.Nsamples_val, cfg.num_epochs, cfg.global_batch_size) == (nsamples, nval, epochs, batch)
    # The reference's enable_amp: fp32 for base and short, mixed precision (fp16 with loss scaling) for *_opt.
    ds_config = json.loads((REPO / cfg.deepspeed_config).read_text())
    assert ds_config.get("fp16", {}).get("enabled", False) is amp and not ds_config.get("bf16", {}).get("enabled")
    assert cfg.base_batch_size == 64 and cfg.data_size == 64
    assert (cfg.lr_schedule.scaling, cfg.lr_schedule.start_lr, cfg.lr_schedule.end_lr) == ("sqrt", 2e-4, 0.0)
    assert cfg.lr_schedule.warmup_steps == 128
    assert (cfg.unet_width, cfg.unet_depth, cfg.lambda_rho) == (64, 6, 0.0)
    assert cfg.weight_init.conv_scale == 0.02
    assert cfg.synthetic is None


def test_debug_config_generates_its_data():
    cfg = _load("debug")
    assert cfg.synthetic is not None and cfg.synthetic.train_box_size == 128
    assert cfg.data_size % 2**cfg.unet_depth == 0


def test_overrides_reach_nested_keys_and_convert_types():
    cfg = _load(
        "base", num_epochs=3, **{"lr_schedule.start_lr": "1e-3", "synthetic.seed": 4, "micro_batch_size": "null"}
    )
    assert cfg.num_epochs == 3 and cfg.lr_schedule.start_lr == 1e-3 and cfg.lr_schedule.scaling == "sqrt"
    assert cfg.synthetic.seed == 4 and cfg.synthetic.train_box_size == 128  # created from the defaults
    assert cfg.micro_batch_size is None


def test_deepspeed_overrides_from_the_command_line_keep_yaml_numbers_numbers():
    # 5e8 and 1e-3 (no dot) are strings to YAML 1.1, numbers to YAML 1.2 and JSON, and to us; quoted, strings.
    overrides_yaml = "{zero_optimization: {stage: 2, reduce_bucket_size: 5e8}, x: [1e-3, '5e8']}"
    _, overrides = parse_args(["--deepspeed_overrides", overrides_yaml, "--lr_schedule.start_lr", "3e-4"])
    cfg = build_config({}, overrides)
    assert cfg.deepspeed_overrides == {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}, "x": [1e-3, "5e8"]}
    assert cfg.lr_schedule.start_lr == 3e-4


def test_command_line_beats_file_beats_defaults():
    args, overrides = parse_args(["--config", "short", "--num_epochs", "7", "--lr_schedule.warmup_steps", "5"])
    cfg = build_config(load_named(YAML, args.config), overrides)
    assert cfg.num_epochs == 7  # command line
    assert cfg.Nsamples == 4096  # file
    assert cfg.log_every_steps == Config().log_every_steps  # default


def test_every_key_is_an_option():
    keys = leaf_keys(Config)
    assert {"num_epochs", "lr_schedule.start_lr", "weight_init.conv_scale", "synthetic.seed"} <= set(keys)
    assert all(help_text for help_text, _ in keys.values()), "every key is documented"
    assert keys["num_epochs"][1] == 10 and keys["lr_schedule.start_lr"][1] == 2e-4 and keys["synthetic"][1] is None


@pytest.mark.parametrize(
    "data, message",
    [
        ({"num_epoch": 3}, "unknown key 'num_epoch' \\(did you mean 'num_epochs'\\?\\)"),
        (
            {"lr_schedule": {"start_l": 1}},
            "unknown key 'lr_schedule.start_l' \\(did you mean 'lr_schedule.start_lr'\\?\\)",
        ),
        ({"full_scale": True}, "unknown key 'full_scale': unet_depth"),
        ({"num_epochs": "ten"}, "num_epochs must be int, got 'ten'"),
        ({"num_epochs": 2.5}, "num_epochs must be int"),
        ({"rotate": "yes"}, "rotate must be bool"),
        ({"lr_schedule": {"start_lr": "fast"}}, "lr_schedule.start_lr must be float"),
        ({"lr_schedule": {"scaling": "cubic"}}, "lr_schedule.scaling must be one of"),
        ({"storage": "disk"}, "storage must be one of"),
        ({"input_vectors": [[1, 2]]}, "input_vectors: a vector needs 3 channels"),
        ({"target_vectors": [[1, 2, 7]]}, "target_vectors: vector channel 7 is out of range"),
        ({"data_size": 48}, "multiple of 2\\^unet_depth"),
        ({"Nsamples": 32}, "smaller than global_batch_size"),
        ({"global_batch_size": 0}, "global_batch_size must be positive"),
        ({"deepspeed_overrides": [1]}, "deepspeed_overrides must be a mapping"),
        ({"synthetic": {"train_box_size": 0}}, "synthetic: box sizes must be at least 2, got 0 and 64"),
        ({"synthetic": {"k_cut": -1.0}}, "synthetic: k_cut must be positive, got -1.0"),
        ({"synthetic": {"seed": -1}}, "synthetic: seed must not be negative"),
        ({"synthetic": {"sigma_log_density": 0.0}}, "synthetic: sigma_log_density must be positive"),
        ({"synthetic": {"gamma": float("nan")}}, "synthetic: gamma must be finite"),
    ],
)
def test_bad_values_are_named(data, message):
    with pytest.raises(ConfigError, match=message):
        build_config(data, {})


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base:\n  num_epochs: [1\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_named(bad, "base")
    with pytest.raises(ConfigError, match="no config named 'nope'.*available: base"):
        load_named(YAML, "nope")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_named(tmp_path / "missing.yaml", "base")


def test_synthetic_block_from_the_command_line():
    _, overrides = parse_args(["--synthetic", json.dumps({"train_box_size": 32, "val_box_size": 32, "seed": 3})])
    cfg = build_config(load_named(YAML, "base"), overrides)
    assert (cfg.synthetic.train_box_size, cfg.synthetic.seed) == (32, 3)


def test_paths_take_variables_from_the_environment(monkeypatch):
    monkeypatch.delenv("DATA_DIR", raising=False)
    assert _load("base").train_path == "/data/downsamp_2048crop_train.h5"
    monkeypatch.setenv("DATA_DIR", "/scratch/me/pm")
    cfg = _load("base")
    assert cfg.train_path == "/scratch/me/pm/downsamp_2048crop_train.h5"
    assert cfg.val_path_npy_label == "/scratch/me/pm/downsamp_1024crop_valid_label.npy"
    with pytest.raises(ConfigError, match="train_path refers to \\$\\{NOPE_DIR\\}, which is not set"):
        _load("base", train_path="${NOPE_DIR}/x.h5")


def test_keys_newer_than_a_saved_run_count_as_their_defaults_on_resume():
    saved = to_dict(Config())
    del saved["deepspeed_overrides"], saved["compile_mode"]  # a run saved before these keys existed
    assert changes_on_resume(saved, Config()) == ({}, {})
    harmless, changing = changes_on_resume(saved, Config(compile_mode="reduce-overhead", deepspeed_overrides={"a": 1}))
    assert harmless == {"compile_mode": ("default", "reduce-overhead")}
    assert changing == {"deepspeed_overrides": ({}, {"a": 1})}


@pytest.fixture
def bare_train_file(tiny_data, tmp_path):
    """The tiny training box without the attribute that declares its normalization, as the reference's files are."""
    bare = tmp_path / "bare.h5"
    shutil.copy(tiny_data["train"], bare)
    with h5py.File(bare, "a") as f:
        del f.attrs["spec"]
    return bare


def test_a_temperature_term_needs_the_normalization_from_the_file_or_the_config(tiny_data, bare_train_file, caplog):
    def loss(train, **overrides):
        return build_loss(_load("debug", train_path=train, val_path=tiny_data["val"], synthetic="null", **overrides))

    assert loss(bare_train_file).temperature_log_range is None  # no temperature term: nothing needs it
    for term in ("lambda_T", "lambda_hot"):
        with pytest.raises(ConfigError) as err:
            loss(bare_train_file, **{term: 0.1})
        assert str(err.value) == (
            f"{term} needs the temperature's normalization, which {bare_train_file} does not declare: set "
            "temperature_log_range (channel 4 holds log10(T / T0) / temperature_log_range)"
        )
    given = loss(bare_train_file, lambda_T=0.1, temperature_log_range=2.5)
    assert (given.lambda_T, given.temperature_log_range) == (0.1, 2.5)
    assert loss(tiny_data["train"], lambda_hot=0.2).temperature_log_range == 3.0  # what the synthetic box declares
    with caplog.at_level("WARNING", logger="trainer.build"):
        assert loss(tiny_data["train"], lambda_T=0.1, temperature_log_range=2.0).temperature_log_range == 2.0
    assert caplog.messages == [
        f"temperature_log_range 2 differs from the 3 that {tiny_data['train']} declares: the config's is used"
    ]


def test_a_run_asking_for_a_temperature_term_it_cannot_compute_stops_in_one_line(tiny_data, bare_train_file, tmp_path):
    args = tiny_args(bare_train_file, tiny_data["val"], tmp_path / "run", "--synthetic", "null", "--lambda_T", "0.1")
    result = run_train(args)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert errors[0].endswith(
        f"lambda_T needs the temperature's normalization, which {bare_train_file} does not "
        "declare: set temperature_log_range (channel 4 holds log10(T / T0) / temperature_log_range)"
    )
