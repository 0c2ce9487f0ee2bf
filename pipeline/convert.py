"""Convert an HDF5 file in the reference layout into the .npy pair the ``npy`` data format reads.

    python -m pipeline.convert data/synthetic/train.h5 --out_prefix data/npy/train --layout DHWC

writes ``<prefix>_data.npy`` (inputs) and ``<prefix>_label.npy`` (targets), one channel at a time
so that memory stays at one channel of the box.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.cli import ArgumentParser, existing_file, output_file
from common.files import written_atomically
from common.hold import HeldError, hold_file
from pipeline.volumes import DataError, VolumeFiles, VolumePair


def convert(h5_path: Path, out_prefix: Path, layout: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """The .npy pair of ``h5_path``; DataError, before anything is written, for a file the trainer would refuse
    or outputs that exist (unless ``overwrite``)."""
    volumes = VolumePair.open(VolumeFiles.hdf5(h5_path), None, None, crop_size=1)
    paths = [out_prefix.with_name(f"{out_prefix.name}_{suffix}.npy") for suffix in ("data", "label")]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        verb = "exists" if len(existing) == 1 else "exist"
        raise DataError(f"{' and '.join(existing)} {verb}: --overwrite replaces them, or choose another --out_prefix")
    # Both outputs are renamed into place only once both are written: a pair is never half old, half new.
    with written_atomically(paths[0]) as data, written_atomically(paths[1]) as label:
        for source, partial in zip((volumes.nbody, volumes.hydro), (data, label), strict=True):
            channels, *box = source.shape
            shape = (channels, *box) if layout == "CDHW" else (*box, channels)
            out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=tuple(shape))
            for c in range(channels):
                if layout == "CDHW":
                    out[c] = source[c]
                else:
                    out[..., c] = source[c]
            out.flush()
            del out
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m pipeline.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("h5_path", type=existing_file, help="HDF5 file with Nbody and Hydro datasets")
    parser.add_argument(
        "--out_prefix", type=output_file, required=True, help="writes <prefix>_data.npy and <prefix>_label.npy"
    )
    parser.add_argument("--layout", choices=["CDHW", "DHWC"], default="CDHW")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    args = parser.parse_args(argv)
    try:
        with hold_file(args.out_prefix, "wait for it to end, or choose another --out_prefix"):
            written = convert(args.h5_path, args.out_prefix, args.layout, overwrite=args.overwrite)
    except (DataError, HeldError) as err:
        parser.error(str(err))
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
