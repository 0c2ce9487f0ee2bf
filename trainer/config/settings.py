"""The settings of an experiment: every config key with its type, default, help and checks, in one dataclass.

Keys are the reference's where it had them (``RENAMED`` says where its others went). What the data path leaves a key
unused for, whether a resumed run may change it and whether it names a file are stated beside it (``_field``:
``trainer.config.fields.key``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.backends import AUTO as BACKEND_AUTO
from pipeline.backends import BACKENDS, TORCH
from pipeline.rotations import check_vector_groups
from pipeline.storage import AUTO as STORAGE_AUTO
from pipeline.storage import STORAGES
from pipeline.synthetic import SyntheticSpec
from trainer.config.fields import key as _field
from trainer.config.sections import Checkpointing, Faults, Sampling, Science, section
from trainer.errors import ConfigError

# The names a config may give: pipeline.storage's modes and pipeline.backends' backends, each with its ``auto``.
StorageName = Literal[(STORAGE_AUTO, *STORAGES)]
BackendName = Literal[(BACKEND_AUTO, *BACKENDS)]


@dataclass(kw_only=True)
class LRSchedule:
    scaling: Literal["sqrt", "linear", "none"] = _field(
        "sqrt", "scale start_lr by sqrt (or linear, or none) of global_batch_size / base_batch_size"
    )
    start_lr: float = _field(2e-4, "learning rate at base_batch_size")
    end_lr: float = _field(0.0, "learning rate reached at the last step")
    warmup_steps: int = _field(
        128, "linear warm-up steps, used (as in the reference) only when scaling is not none and global > base batch"
    )


@dataclass
class WeightInit:
    conv_scale: float = _field(0.02, "standard deviation of the conv weights")
    conv_bias: float | None = _field(0.0, "value of the conv biases (null: keep PyTorch's init)")


@dataclass(kw_only=True)
class Config:
    description: str = _field("", "one line saying what a named config is for (--help lists them)", resumable=True)
    # Data
    train_path: str = _field(
        "/data/downsamp_2048crop_train.h5", "HDF5 file with the training box", path="hdf5", resumable=True
    )
    val_path: str = _field(
        "/data/downsamp_1024crop_valid.h5", "HDF5 file with the validation box", path="hdf5", resumable=True
    )
    synthetic: SyntheticSpec | None = _field(
        None, "if set, missing train/val files are generated from this synthetic spec on first use"
    )
    data_format: Literal["hdf5", "npy"] = _field(
        "hdf5", "hdf5: train_path/val_path; npy: the *_npy_data/*_npy_label files"
    )
    train_path_npy_data: str = _field(
        "/data/downsamp_2048crop_train_data.npy",
        "training inputs as .npy (data_format npy)",
        path="npy",
        resumable=True,
    )
    train_path_npy_label: str = _field(
        "/data/downsamp_2048crop_train_label.npy", "training targets as .npy", path="npy", resumable=True
    )
    val_path_npy_data: str = _field(
        "/data/downsamp_1024crop_valid_data.npy", "validation inputs as .npy", path="npy", resumable=True
    )
    val_path_npy_label: str = _field(
        "/data/downsamp_1024crop_valid_label.npy", "validation targets as .npy", path="npy", resumable=True
    )
    npy_layout: Literal["CDHW", "DHWC", "bricks"] = _field(
        "CDHW",
        "axis order of the .npy volumes: channels first or last, or bricks (the fastest for storage lazy: "
        "python -m pipeline.convert --layout bricks)",
    )
    storage: StorageName = _field(
        "auto",
        "lazy: read each crop from the files (the reference's lowmem); host: load the volumes into memory, one copy "
        "per node (inmem); device: load them into GPU memory and cut crops there (falls back to host without a GPU); "
        "auto: device where the volumes and the training fit the GPU, else host where the node's memory fits, else "
        "lazy",
        resumable=True,
        tunable=True,
    )
    device_storage_dtype: Literal["float32", "float16"] = _field(
        "float32",
        "precision of the input volume kept on the GPU (storage device); float16 halves it (the targets stay float32, "
        "the precision of the loss)",
        resumable=True,
        unused=lambda cfg, storage, backend, device: not storage.on_device,
    )
    backend: BackendName = _field(
        "auto",
        "dali: DALI pipelines make the samples; torch: the same samples from threads and torch ops; auto: dali on a "
        "GPU, torch on a CPU (measured faster there)",
        resumable=True,
        tunable=True,
    )
    data_size: int = _field(64, "side of the training crops in voxels", bound="positive")
    Nsamples: int = _field(65536, "training samples per epoch (over all ranks)", bound="positive")
    Nsamples_val: int = _field(8192, "validation samples per evaluation (over all ranks)", bound="positive")
    last_batch: Literal["partial", "drop"] = _field(
        "partial", "validation samples that do not fill a last batch: evaluate them in a smaller batch, or drop them"
    )
    N_in_channels: int = _field(4, "input channels (dark-matter density, vx, vy, vz)")
    N_out_channels: int = _field(5, "output channels (gas density, vx, vy, vz, temperature)")
    input_vectors: list[list[int]] = _field(
        [[1, 2, 3]],
        "input channels that form vectors, each listed as its components along array axes 1, 2, 3 (the reference's "
        "files store x, y, z in that order; a (z, y, x) file with channels [rho, vx, vy, vz] is [[3, 2, 1]])",
    )
    target_vectors: list[list[int]] = _field([[1, 2, 3]], "target channels that form vectors, as input_vectors")
    rotate: bool = _field(True, "apply one of the 24 rotations of the cube to each training sample")
    num_data_workers: int = _field(
        2,
        "threads per rank cutting crops on the CPU",
        bound="positive",
        resumable=True,
        unused=lambda cfg, storage, backend, device: storage.on_device,
        tunable=True,
    )
    data_prefetch: int = _field(
        2,
        "batches cut ahead of the one being trained on",
        bound="non-negative",
        resumable=True,
        unused=lambda cfg, storage, backend, device: storage.on_device and backend == TORCH,
    )
    # Model
    unet_width: int = _field(64, "channels of the first U-Net level (64 in the reference)", bound="positive")
    unet_depth: int = _field(6, "U-Net levels: 6 is the reference's full_scale: True, 5 its full_scale: False")
    weight_init: WeightInit = _field(WeightInit(), "initialization of the network")
    lambda_rho: float = _field(
        0.0, "weight of the extra L1 term on gas density in original space", bound="non-negative"
    )
    lambda_pk: float = _field(
        0.0,
        "weight of the loss term on the crops' power spectra (per channel, sum over shells of k of |P_pred - P_true| "
        "over the true total power)",
        bound="non-negative",
    )
    lambda_T: float = _field(
        0.0,
        "weight of the extra L1 term on the temperature in physical units, relative to its mean (needs the "
        "temperature's normalization: temperature_log_range or the training file's)",
        bound="non-negative",
    )
    lambda_hot: float = _field(
        0.0,
        "weight of the extra L1 term on the normalized temperature, each voxel weighted by T / mean T (needs the "
        "temperature's normalization, as lambda_T)",
        bound="non-negative",
    )
    lambda_T_mse: float = _field(
        0.0,
        "weight of a squared-error term on the temperature in physical units, relative to its mean squared (needs "
        "the temperature's normalization, as lambda_T)",
        bound="non-negative",
    )
    lambda_T_power: float = _field(
        0.0,
        "weight of a term on the temperature's fluctuation power in physical units: |log(P_pred / P_true)| per "
        "shell of k of the batch's crops, up to a quarter of their Nyquist (needs the temperature's normalization, "
        "as lambda_T)",
        bound="non-negative",
    )
    lambda_v: float = _field(
        0.0,
        "weight of an extra L1 term on the gas velocity channels (target_vectors' first group)",
        bound="non-negative",
    )
    lambda_div: float = _field(
        0.0,
        "weight of an L1 term on the gas velocity's divergence (central differences inside each crop), predicted "
        "against true",
        bound="non-negative",
    )
    temperature_log_range: float | None = _field(
        None,
        "the targets' temperature normalization: channel 4 holds log10(T / T0) / temperature_log_range (null: what "
        "the training file declares; the synthetic boxes declare theirs, the reference's files do not)",
        bound="positive",
    )
    # Optimization
    num_epochs: int = _field(10, "training epochs", bound="positive")
    global_batch_size: int = _field(64, "samples per optimizer step, over all ranks", bound="positive")
    base_batch_size: int = _field(64, "batch size at which lr_schedule.start_lr applies", bound="positive")
    micro_batch_size: int | None = _field(
        None,
        "samples per rank per forward pass (null: global_batch_size / world size, no accumulation)",
        bound="positive",
        tunable=True,
    )
    lr_schedule: LRSchedule = _field(LRSchedule(), "learning-rate schedule")
    deepspeed_config: str = _field("ds_configs/ds_fp16.json", "DeepSpeed JSON: precision, optimizer, ZeRO", path="file")
    gradient_reduction: Literal["after_backward", "overlapped"] = _field(
        "after_backward",
        "ZeRO stage 0's gradient all-reduce over the ranks: DeepSpeed's own after backward, or overlapped with "
        "backward in buckets launched as the gradients come (stage 0 only; ZeRO stages reduce their own way)",
        resumable=True,
        tunable=True,
    )
    reduce_bucket_mb: float = _field(
        25.0,
        "with gradient_reduction: overlapped, the gradients per all-reduce (a weight larger than it goes alone)",
        bound="positive",
        resumable=True,
        tunable=True,
    )
    deepspeed_overrides: dict = _field(
        {},
        "settings merged into that JSON, mapping by mapping: {zero_optimization: {reduce_bucket_size: 200000000}}",
        tunable=True,
    )
    # Fast paths: switches on the same code, each pinned to the plain path by an equivalence test
    channels_last: bool | None = _field(
        None,
        "batches in channels-last 3D memory format (NDHWC), which convolutions then keep through the network "
        "(the weights stay as they are: DeepSpeed broadcasts and flattens parameters as contiguous tensors); "
        "null: on with a GPU, where it measured faster",
        resumable=True,
        tunable=True,
    )
    cudnn_benchmark: bool | None = _field(
        None,
        "let cuDNN time and pick convolution algorithms (null: on with a GPU)",
        resumable=True,
        tunable=True,
    )
    cudnn_benchmark_limit: int | None = _field(
        None,
        "with cudnn_benchmark, how many convolution algorithms cuDNN times per shape: 0 every one it has "
        "(slower first steps); null: torch's default (10)",
        bound="non-negative",
        resumable=True,
        tunable=True,
    )
    pad_last_layer: bool = _field(
        False,
        "compute the last layer's 5 output channels as 8, with zero filters, and drop the 3 (the same values and "
        "checkpoints; tensor cores want multiples of 8)",
        resumable=True,
    )
    compile: bool = _field(
        False,
        "compile the model with torch.compile through the engine (engine.compile())",
        resumable=True,
        tunable=True,
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = _field(
        "default",
        "torch.compile's mode with compile: true (reduce-overhead: CUDA graphs of the forward and backward; "
        "max-autotune: searched kernels, and CUDA graphs too)",
        resumable=True,
        tunable=True,
    )
    seed: int = _field(0, "base seed: model init, and crops (each rank draws with seed + global rank)")
    accumulate_as_ranks: bool = _field(
        False,
        "draw each accumulated micro-batch as a rank of its own would (micro-batch k of a step on rank r is what rank "
        "r x accumulation + k draws without accumulation): a run with accumulation sees the samples of one with that "
        "many more ranks",
    )
    # Logging and checkpoints
    log_every_steps: int = _field(20, "optimizer steps between log points", bound="positive", resumable=True)
    noise_scale: bool = _field(
        True,
        "measure the gradient noise scale (the critical batch, B_simple) at every log point, from each rank's and "
        "each accumulated micro-batch's gradient against the step's, on the first eighth of each log interval's "
        "steps; with one rank and no accumulation those steps' micro-batches are split in two for it "
        "(docs/training.md, Gradient noise scale)",
        resumable=True,
    )
    checkpoint_keep: int = _field(
        3,
        "checkpoints kept in the run directory (the newest ones, whichever cadence saved them)",
        bound="positive",
        resumable=True,
    )
    checkpoint_every_epochs: int = _field(
        1,
        "save after every this many epochs (0: none but the last); a stop and the end always save",
        bound="non-negative",
        resumable=True,
    )
    checkpoint_every_steps: int | None = _field(
        None, "also save every this many optimizer steps (null: not by steps)", bound="positive", resumable=True
    )
    checkpoint_every_minutes: float | None = _field(
        None,
        "also save every this many minutes of training, on the optimizer step every rank agrees on at a log "
        "point (null: not by time)",
        bound="positive",
        resumable=True,
    )
    cpu_threads: int | None = _field(
        None,
        "torch threads per rank on CPU (null: cores / ranks on this node)",
        bound="positive",
        resumable=True,
        tunable=True,
    )
    dist_timeout_s: float = _field(
        600.0, "how long a collective waits for a missing rank before failing", bound="positive", resumable=True
    )
    science_every_epochs: int = _field(
        0,
        "every this many epochs, predict the validation box (tiled) and log its science metrics (0: never)",
        bound="non-negative",
        resumable=True,
    )
    science_box_size: int | None = _field(
        None,
        "side of the fixed sub-volume (at the validation box's origin, taken as periodic) that those metrics "
        "cover; null: the whole box",
        resumable=True,
    )
    # Faults
    nonfinite_loss: Literal["skip", "stop", "ignore"] = _field(
        "skip",
        "a NaN or Inf loss on any rank: skip that batch on every rank, stop the run, or do not check (ignore) "
        "(checking costs one small reduction and one sync per step)",
        resumable=True,
    )
    max_nonfinite_in_a_row: int = _field(
        10,
        "with nonfinite_loss skip: stop after this many non-finite losses in a row",
        bound="positive",
        resumable=True,
    )
    data_checks: Literal["startup", "every_batch", "none"] = _field(
        "startup",
        "NaN/Inf in the data: check the volumes at start-up (all of them up to 1 GiB, else sampled crops), "
        "also every batch (one reduction and sync per step), or none",
        resumable=True,
    )

    @property
    def checkpointing(self) -> Checkpointing:
        return section(Checkpointing, self, "checkpoint_")

    @property
    def faults(self) -> Faults:
        return section(Faults, self)

    @property
    def science(self) -> Science:
        return section(Science, self, "science_")

    @property
    def sampling(self) -> Sampling:
        return section(Sampling, self)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value, bound = getattr(self, f.name), f.metadata["bound"]
            if value is None or bound is None:
                continue
            if bound == "positive" and value <= 0:
                raise ConfigError(f"{f.name} must be positive, got {value}")
            if bound == "non-negative" and value < 0:
                raise ConfigError(f"{f.name} must not be negative, got {value}")
        if self.science_box_size is not None and self.science_box_size < self.data_size:
            raise ConfigError(f"science_box_size {self.science_box_size} is smaller than data_size {self.data_size}")
        if self.synthetic is not None and self.data_format != "hdf5":
            raise ConfigError("synthetic data is written as HDF5: use data_format hdf5 with a synthetic block")
        if self.synthetic is not None and (problem := self.synthetic.problem()):
            raise ConfigError(f"synthetic: {problem}")
        if self.data_size % 2**self.unet_depth:
            raise ConfigError(f"data_size {self.data_size} must be a multiple of 2^unet_depth = {2**self.unet_depth}")
        if self.Nsamples < self.global_batch_size:
            raise ConfigError(f"Nsamples {self.Nsamples} is smaller than global_batch_size {self.global_batch_size}")
        if self.lr_schedule.start_lr <= 0 or self.lr_schedule.end_lr < 0:
            raise ConfigError("lr_schedule.start_lr must be positive and lr_schedule.end_lr not negative")
        for key, groups, channels in (
            ("input_vectors", self.input_vectors, self.N_in_channels),
            ("target_vectors", self.target_vectors, self.N_out_channels),
        ):
            try:
                check_vector_groups(groups, channels)
            except ValueError as err:
                raise ConfigError(f"{key}: {err}") from None


# Reference keys that we spell differently, so that its users learn where their knob went.
RENAMED = {
    "full_scale": "unet_depth (6 = full_scale: True, 5 = full_scale: False)",
    "enable_amp": "precision is set by the DeepSpeed JSON (deepspeed_config): ds_configs/ds_fp32.json is enable_amp: "
    "False, ds_configs/ds_fp16.json (or ds_bf16.json) enable_amp: True",
    "enable_apex": "the optimizer is set in the DeepSpeed JSON (deepspeed_config)",
    "enable_jit": "no JIT switch yet",
    "data_loader_config": "storage (inmem = host, lowmem = lazy) and backend (dali or torch)",
    "box_size": "the box size is read from the data files",
    "expdir": "the --run_dir option",
}


def leaf_keys(cls: type = Config, prefix: str = "") -> dict[str, tuple[str, Any]]:
    """Dotted key -> (help, default), for every overridable field (nested dataclasses expanded, and themselves)."""
    keys: dict[str, tuple[str, Any]] = {}
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        keys[key] = (f.metadata.get("help", ""), getattr(defaults, f.name))
        inner = [h for h in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(h)]
        if inner:
            keys.update(leaf_keys(inner[0], key + "."))
    return keys


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# What a resumed run may change without changing what it learns (the keys marked resumable).
RESUMABLE = frozenset(f.name for f in dataclasses.fields(Config) if f.metadata["resumable"])
# What bench.tune may change (the keys marked tunable), and the recipe it must keep: every other key but the
# description, so that a key added to the config (a loss term, say) is kept by the tuner from the start.
TUNABLE = tuple(f.name for f in dataclasses.fields(Config) if f.metadata["tunable"])
RECIPE = tuple(f.name for f in dataclasses.fields(Config) if not f.metadata["tunable"] and f.name != "description")


def channels_last_on(cfg: Config, device_type: str) -> bool:
    """``channels_last`` for this device: null is on with a GPU (convolutions measured faster there), off on CPUs."""
    return device_type == "cuda" if cfg.channels_last is None else cfg.channels_last


# Keys naming files: ${VAR} and ${VAR:-default} in them are taken from the environment, so that a site's
# data directory (DATA_DIR in slurm/train.sbatch) needs no edit of the configs.
PATH_KEYS = tuple(f.name for f in dataclasses.fields(Config) if f.metadata["path"])
