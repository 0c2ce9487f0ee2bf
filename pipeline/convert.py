"""Convert an HDF5 file in the reference layout into the .npy pair the ``npy`` data format reads.

    python -m pipeline.convert data/synthetic/train.h5 --out_prefix data/npy/train --layout DHWC

writes ``<prefix>_data.npy`` (inputs) and ``<prefix>_label.npy`` (targets), one channel at a time
so that memory stays at one channel of the box.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import h5py
import numpy as np

from pipeline.layout import HYDRO_DATASET, NBODY_DATASET


def convert(h5_path: Path, out_prefix: Path, layout: str) -> tuple[Path, Path]:
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    written = []
    with h5py.File(h5_path, "r") as f:
        for name, suffix in ((NBODY_DATASET, "data"), (HYDRO_DATASET, "label")):
            source = f[name]
            channels, *box = source.shape
            shape = (channels, *box) if layout == "CDHW" else (*box, channels)
            path = out_prefix.with_name(f"{out_prefix.name}_{suffix}.npy")
            out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=tuple(shape))
            for c in range(channels):
                if layout == "CDHW":
                    out[c] = source[c]
                else:
                    out[..., c] = source[c]
            out.flush()
            written.append(path)
    return written[0], written[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("h5_path", type=Path)
    parser.add_argument("--out_prefix", type=Path, required=True, help="writes <prefix>_data.npy and <prefix>_label.npy")
    parser.add_argument("--layout", choices=["CDHW", "DHWC"], default="CDHW")
    args = parser.parse_args(argv)
    for path in convert(args.h5_path, args.out_prefix, args.layout):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
