"""A trained emulator: the U-Net's weights and the settings it was trained with, loadable without DeepSpeed.

Sources: a run directory (its config.json and a DeepSpeed checkpoint, whose model file holds only
plain tensors and types) or a single exported weights file (``python -m model.export``).

    python -m model.export --run_dir runs/debug-20261202-120000 --out emulator.pt
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from model.unet import UNet


@dataclass(frozen=True)
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
        return cls(
            config["N_in_channels"], config["N_out_channels"], config["unet_width"], config["unet_depth"],
            config["data_size"], config["input_vectors"], config["target_vectors"],
        )  # fmt: skip


@dataclass
class Emulator:
    spec: EmulatorSpec
    model: UNet
    source: str

    def to(self, device: torch.device) -> Emulator:
        self.model.to(device)
        return self


def _build(spec: EmulatorSpec, state: dict[str, torch.Tensor], source: str) -> Emulator:
    model = UNet(spec.in_channels, spec.out_channels, spec.width, spec.depth)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.eval()
    return Emulator(spec, model, source)


def latest_run(runs: Path = Path("runs")) -> Path:
    """The most recently modified run directory that holds a checkpoint."""
    candidates = [p for p in runs.glob("*") if (p / "checkpoints" / "latest").is_file()]
    if not candidates:
        raise FileNotFoundError(f"no run with a checkpoint under {runs}/: train first, or pass --run_dir or --weights")
    return max(candidates, key=lambda p: (p / "checkpoints" / "latest").stat().st_mtime)


def from_run_dir(run_dir: Path, tag: str | None = None) -> Emulator:
    """The weights of checkpoint ``tag`` (default: the latest) of a run directory.

    Under fp16 DeepSpeed keeps the module's weights in fp16 (the fp32 master copy is optimizer
    state): they are read as saved and widened to fp32.
    """
    config = json.loads((run_dir / "config.json").read_text())
    tag = tag or (run_dir / "checkpoints" / "latest").read_text().strip()
    path = run_dir / "checkpoints" / tag / "mp_rank_00_model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)["module"]
    return _build(EmulatorSpec.from_config(config["config"]), state, f"{run_dir} checkpoint {tag}")


def export(emulator: Emulator, out: Path) -> None:
    """One file: float32 weights and the spec, readable with torch.load(weights_only=True)."""
    state = {k: v.detach().float().cpu() for k, v in emulator.model.state_dict().items()}
    torch.save({"format": "cosmo-emulator/1", "spec": asdict(emulator.spec), "state_dict": state, "source": emulator.source}, out)


def from_weights(path: Path) -> Emulator:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != "cosmo-emulator/1":
        raise ValueError(f"{path}: not an exported emulator (python -m model.export writes them)")
    return _build(EmulatorSpec(**saved["spec"]), saved["state_dict"], str(path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a run's checkpoint as one weights file, loadable without DeepSpeed.")
    parser.add_argument("--run_dir", type=Path, help="run directory (default: the newest under runs/ with a checkpoint)")
    parser.add_argument("--tag", help="checkpoint tag (default: the latest)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    emulator = from_run_dir(args.run_dir or latest_run(), args.tag)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    export(emulator, args.out)
    print(f"wrote {args.out} from {emulator.source}")
