"""A trained emulator: the U-Net's weights and the settings it was trained with, loadable without DeepSpeed.

Sources: a run directory (its config.json and a DeepSpeed checkpoint, whose model file holds only
plain tensors and types) or a single exported weights file (``python -m model.export``).

    python -m model.export --run_dir runs/debug-20261202-120000 --out emulator.pt
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from common.cli import ArgumentParser, existing_dir, output_file
from common.files import written_atomically
from common.hold import HeldError, hold_file
from common.outputs import OutputError, claim_files, refuse_inputs
from model.checkpoints import (
    CHECKPOINT_DIR,
    LATEST,
    MODEL_STATES,
    RUN_CONFIG,
    checkpoint_problem,
    checkpoint_tags,
    latest_tag,
    newest_intact,
)
from model.unet import UNet, UNetSpec

log = logging.getLogger(__name__)

FORMAT = "cosmo-emulator/1"  # what an exported file says it is


@dataclass(frozen=True, kw_only=True)
class EmulatorSpec:
    """What it takes to rebuild and use the network: architecture, crop size and channel layout."""

    in_channels: int
    out_channels: int
    width: int
    depth: int
    crop_size: int
    input_vectors: list[list[int]]
    target_vectors: list[list[int]]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EmulatorSpec:
        unet = UNetSpec.from_config(config)
        return cls(
            **asdict(unet),
            crop_size=config["data_size"],
            input_vectors=config["input_vectors"],
            target_vectors=config["target_vectors"],
        )

    @property
    def unet(self) -> UNetSpec:
        return UNetSpec(
            in_channels=self.in_channels, out_channels=self.out_channels, width=self.width, depth=self.depth
        )


@dataclass
class Emulator:
    spec: EmulatorSpec
    model: UNet
    source: str

    def to(self, device: torch.device) -> Emulator:
        self.model.to(device)
        return self


class EmulatorError(ValueError):
    """A run directory, checkpoint or weights file that cannot give an emulator: one line saying why."""


def _load(path: Path) -> Any:
    if not path.is_file():
        raise EmulatorError(f"{path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # arbitrary bytes fail in the unpickler or the zip reader in many ways (KeyError...)
        reason = " ".join(str(err).split()).split(". ")[0][:80]
        raise EmulatorError(f"{path}: damaged, not a readable torch file ({type(err).__name__}: {reason})") from None


def _build(spec: EmulatorSpec, state: dict[str, torch.Tensor], source: str) -> Emulator:
    model = spec.unet.build()
    try:
        model.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise EmulatorError(f"{source}: the weights do not fit the network its settings describe ({first})") from None
    model.eval()
    return Emulator(spec, model, source)


def latest_run(runs: Path = Path("runs")) -> Path:
    """The most recently modified run directory that holds a checkpoint."""
    candidates = [p for p in runs.glob("*") if (p / CHECKPOINT_DIR / LATEST).is_file()]
    if not candidates:
        raise EmulatorError(f"no run with a checkpoint under {runs}/: train first, or pass --run_dir or --weights")
    return max(candidates, key=lambda p: (p / CHECKPOINT_DIR / LATEST).stat().st_mtime)


def from_run_dir(run_dir: Path, tag: str | None = None) -> Emulator:
    """The weights of checkpoint ``tag`` (default: the latest) of a run directory.

    Under fp16 DeepSpeed keeps the module's weights in fp16 (the fp32 master copy is optimizer
    state): they are read as saved and widened to fp32.
    """
    if not (run_dir / RUN_CONFIG).is_file():
        raise EmulatorError(f"{run_dir}: not a run directory (no {RUN_CONFIG})")
    try:
        spec = EmulatorSpec.from_config(json.loads((run_dir / RUN_CONFIG).read_text())["config"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        why = f"{type(err).__name__}: {err}"
        raise EmulatorError(f"{run_dir / RUN_CONFIG}: not a run's resolved config ({why})") from None
    checkpoints = run_dir / CHECKPOINT_DIR
    if tag is None:  # the newest intact one, said where newer ones are damaged
        if latest_tag(run_dir) is None and not checkpoint_tags(run_dir):
            raise EmulatorError(f"{run_dir}: no checkpoint yet")
        tag, damaged = newest_intact(run_dir)
        for bad, problem in damaged:
            log.warning("checkpoint %s is damaged (%s): not used", checkpoints / bad, problem)
        if tag is None:
            raise EmulatorError(f"{run_dir}: no intact checkpoint ({'; '.join(f'{t}: {p}' for t, p in damaged)})")
        if damaged:
            log.warning("using %s, the newest intact checkpoint", tag)
    elif not (checkpoints / tag).is_dir():
        found = checkpoint_tags(run_dir)
        raise EmulatorError(f"{run_dir}: no checkpoint {tag!r} (found: {', '.join(found) or 'none'})")
    elif problem := checkpoint_problem(checkpoints / tag):
        raise EmulatorError(f"{checkpoints / tag}: damaged ({problem})")
    saved = _load(checkpoints / tag / MODEL_STATES)
    if not isinstance(saved, dict) or "module" not in saved:
        raise EmulatorError(f"{checkpoints / tag}: not a DeepSpeed model checkpoint (no 'module' weights)")
    return _build(spec, saved["module"], f"{run_dir} checkpoint {tag}")


def export(emulator: Emulator, out: Path) -> None:
    """One file: float32 weights and the spec, readable with torch.load(weights_only=True); an interrupted export
    leaves no half file."""
    state = {k: v.detach().float().cpu() for k, v in emulator.model.state_dict().items()}
    saved = {
        "format": FORMAT,
        "spec": asdict(emulator.spec),
        "state_dict": state,
        "source": emulator.source,
    }
    try:
        with written_atomically(out) as tmp:
            torch.save(saved, tmp)
    except (OSError, RuntimeError) as err:  # torch's writer turns a failed write into a RuntimeError of its own
        why = err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())[:80]
        raise EmulatorError(f"{out}: could not be written ({why}); nothing was replaced") from None


def from_weights(path: Path) -> Emulator:
    saved = _load(path)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise EmulatorError(f"{path}: not an exported emulator (python -m model.export writes them)")
    try:
        spec = EmulatorSpec(**saved["spec"])
    except (KeyError, TypeError) as err:
        why = f"{type(err).__name__}: {err}"
        raise EmulatorError(f"{path}: an exported emulator without a usable spec ({why})") from None
    return _build(spec, saved["state_dict"], str(path))


def is_export(path: Path) -> bool:
    """Whether ``path`` is an emulator that ``export`` wrote (before marks existed, its content says so)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # any file at all: not one
        return False
    return isinstance(saved, dict) and saved.get("format") == FORMAT


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m model.export",
        description="Export a run's checkpoint as one weights file, loadable without DeepSpeed.",
    )
    parser.add_argument(
        "--run_dir", type=existing_dir, help="run directory (default: the newest under runs/ with a checkpoint)"
    )
    parser.add_argument("--tag", help="checkpoint tag (default: the newest intact one)")
    parser.add_argument("--out", type=output_file, required=True, help="the file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an --out that an earlier export wrote")
    args = parser.parse_args(argv)
    try:
        with hold_file(args.out, "wait for it to end, or choose another --out"):
            run_dir = args.run_dir or latest_run()
            refuse_inputs([args.out], [run_dir / RUN_CONFIG, *(run_dir / CHECKPOINT_DIR).rglob(MODEL_STATES)])
            advice = "choose another --out"
            claim_files([args.out], by="model.export", overwrite=args.overwrite, legacy=is_export, advice=advice)
            emulator = from_run_dir(run_dir, args.tag)
            export(emulator, args.out)
    except (EmulatorError, HeldError, OutputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} from {emulator.source}")
    return 0
