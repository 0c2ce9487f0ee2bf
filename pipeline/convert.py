"""Convert HDF5 files in the reference layout into the .npy pairs the ``npy`` data format reads; bricks by default,
the layout that reads crops fastest (docs/data.md, At full scale).

    python -m pipeline.convert downsamp_2048crop_train.h5 downsamp_1024crop_valid.h5 --out_dir /local/ssd/data
    python -m pipeline.convert data/synthetic/train.h5 --out_prefix data/npy/train --layout DHWC

writes ``<prefix>_data.npy`` (inputs) and ``<prefix>_label.npy`` (targets) for each file, a slab of the box at a time
so that memory stays at a slab; a node-local ``--out_dir`` makes each node's copy (``srun --ntasks-per-node 1``).
Files the project did not write are never replaced, and what a killed conversion left is reclaimed by the next one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.cli import ArgumentParser, existing_file, output_dir, output_file
from common.files import reclaim, temporaries, written_atomically
from common.hold import HeldError, hold_file
from common.outputs import OutputError, claim_files, refuse_inputs
from pipeline.bricks import to_bricks
from pipeline.volumes import DataError, VolumeFiles, VolumePair

LAYOUTS = ("bricks", "CDHW", "DHWC")
BRICK = 32  # a 64^3 crop reads 27 bricks at most


def _shape(source_shape: tuple[int, ...], layout: str, brick: int) -> tuple[int, ...]:
    channels, *box = source_shape
    if layout == "CDHW":
        return (channels, *box)
    if layout == "DHWC":
        return (*box, channels)
    n = box[0] // brick
    return (n, n, n, channels, brick, brick, brick)


def _write(source, out: np.ndarray, layout: str, *, brick: int) -> None:
    """Copy a (C, L, L, L) volume into ``out`` in ``layout``, a slab of planes (a row of bricks) at a time."""
    step = brick if layout == "bricks" else max(1, 2**26 // max(1, source.shape[0] * source.shape[2] ** 2))
    for x in range(0, source.shape[1], step):
        slab = np.asarray(source[:, x : x + step], dtype=np.float32)
        if layout == "CDHW":
            out[:, x : x + step] = slab
        elif layout == "DHWC":
            out[x : x + step] = slab.transpose(1, 2, 3, 0)
        else:
            out[x // brick] = to_bricks(slab, brick)[0]  # one row of bricks


def outputs(out_prefix: Path) -> list[Path]:
    """The .npy pair written for ``out_prefix``: inputs, then targets."""
    return [out_prefix.with_name(f"{out_prefix.name}_{suffix}.npy") for suffix in ("data", "label")]


def reclaim_partials(out_prefix: Path) -> str:
    """Remove what conversions to ``out_prefix`` that were killed left under temporary names; the line saying so."""
    found = temporaries(out_prefix.parent, [p.name for p in outputs(out_prefix)])
    return reclaim(found, what="what killed conversions left")


def convert(
    h5_path: Path, out_prefix: Path, layout: str, *, brick: int = BRICK, overwrite: bool = False
) -> tuple[Path, Path]:
    """The .npy pair of ``h5_path``; DataError, before anything is written, for a file the trainer would refuse, a
    box that bricks do not tile, an output that is the input, or outputs that exist (unless ``overwrite``, and never
    a file the project did not write)."""
    paths = outputs(out_prefix)
    try:
        refuse_inputs(paths, [h5_path])
    except OutputError as err:
        raise DataError(str(err)) from None
    volumes = VolumePair.open(VolumeFiles.hdf5(h5_path), None, None, crop_size=1)
    if layout == "bricks" and volumes.box_size % brick:
        raise DataError(f"{h5_path}: a {volumes.box_size}^3 box is not a whole number of {brick}^3 bricks: --brick")
    try:
        claim_files(paths, by="pipeline.convert", overwrite=overwrite, advice="choose another --out_prefix")
    except OutputError as err:
        raise DataError(str(err)) from None
    # Both outputs are renamed into place only once both are written: a pair is never half old, half new.
    with written_atomically(paths[0]) as data, written_atomically(paths[1]) as label:
        for source, partial in zip((volumes.nbody, volumes.hydro), (data, label), strict=True):
            shape = _shape(tuple(source.shape), layout, brick)
            out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=shape)
            _write(source, out, layout, brick=brick)
            out.flush()
            del out
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m pipeline.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("h5_paths", type=existing_file, nargs="+", help="HDF5 files with Nbody and Hydro datasets")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out_prefix", type=output_file, help="one file: writes <prefix>_data.npy, <prefix>_label.npy")
    where.add_argument("--out_dir", type=output_dir, help="writes <dir>/<name>_data.npy, <dir>/<name>_label.npy each")
    parser.add_argument("--layout", choices=LAYOUTS, default="bricks", help="npy_layout of the files written")
    parser.add_argument("--brick", type=int, default=BRICK, help="with --layout bricks: the side of a brick")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs an earlier conversion wrote")
    args = parser.parse_args(argv)
    if args.out_prefix is not None and len(args.h5_paths) > 1:
        parser.error("--out_prefix names one file's outputs: use --out_dir for several")
    prefixes = [args.out_prefix] if args.out_prefix else [args.out_dir / p.stem for p in args.h5_paths]
    for h5_path, prefix in zip(args.h5_paths, prefixes, strict=True):
        try:
            with hold_file(prefix, "wait for it to end, or choose another output"):
                if reclaimed := reclaim_partials(prefix):  # the hold: no live conversion writes them
                    print(reclaimed)
                written = convert(h5_path, prefix, args.layout, brick=args.brick, overwrite=args.overwrite)
        except (DataError, HeldError) as err:
            parser.error(str(err))
        for path in written:
            print(f"wrote {path}")
    print(f"train with: --data_format npy --npy_layout {args.layout} and the *_npy_data / *_npy_label paths above")


if __name__ == "__main__":
    main()
