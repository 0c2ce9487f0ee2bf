"""Train the cosmology emulator U-Net through a DeepSpeed engine, fed by DALI.

    python ds_train.py --config debug                      # built-in config, synthetic data
    python ds_train.py --config base --num_epochs 3 --lr_schedule.start_lr 1e-3
    python ds_train.py --run_dir runs/debug-20261202-120000 --resume
    deepspeed --num_gpus 4 ds_train.py --config bs256_opt

Every config key is an option (--key value, dotted for nested keys); see --help.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist

from pipeline.cli import output_dir
from trainer.checkpoint import CHECKPOINT_DIR
from trainer.config import (
    Config,
    ConfigError,
    build_config,
    changes_on_resume,
    config_parser,
    load_named,
    parse_config_options,
)
from trainer.dist import DistEnv, DistError
from trainer.errors import NumericalError
from trainer.preemption import PREEMPTED_EXIT, StopRequest
from trainer.trainer import USER_ERRORS, Trainer, init_distributed, prepare_data, write_resolved_config

log = logging.getLogger("ds_train")
# Exit statuses: 2 bad input (config, data, environment, checkpoint), 3 training diverged,
# 75 stopped on request after a checkpoint (resume with --resume).
DIVERGED_EXIT = 3
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "train.log", "tensorboard", CHECKPOINT_DIR)
# --overwrite moves the earlier run here, and deletes it only once the new run has passed its checks.
SET_ASIDE = ".overwritten"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    """Fixed options, plus every config key as an override (returned as dotted key -> raw value)."""
    parser = config_parser(
        "ds_train.py",
        __doc__.split("\n\n")[0],
        sys.argv[1:] if argv is None else argv,
        usage="%(prog)s [--config NAME] [--run_dir DIR] [--resume | --overwrite] [--KEY VALUE ...]",
    )
    parser.add_argument("--run_dir", type=output_dir, help="run directory (default: runs/<config>-<date>-<time>)")
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --run_dir from its latest checkpoint"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="start afresh in a --run_dir that holds an earlier run, deleting it"
    )
    parser.add_argument(
        "--allow_config_change", action="store_true", help="with --resume: accept settings that change the training"
    )
    parser.add_argument(
        "--stop_after_epoch", type=int, help="stop after this epoch; the schedule still spans num_epochs"
    )
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return parse_config_options(parser, argv)


def resolve_config(args: argparse.Namespace, overrides: dict[str, str]) -> tuple[str, Config]:
    """A new run's config from the YAML; a resumed run's from its run directory (overrides on top)."""
    if not args.resume:
        return args.config, build_config(load_named(args.yaml_config, args.config), overrides)
    if args.run_dir is None:
        raise ConfigError("--resume needs --run_dir")
    refuse_leftover_set_aside(args.run_dir)
    saved_path = args.run_dir / "config.json"
    if not saved_path.is_file():
        raise ConfigError(f"--resume: {saved_path} not found; is {args.run_dir} a run directory?")
    saved = json.loads(saved_path.read_text())
    cfg = build_config(saved["config"], overrides)
    harmless, changing = changes_on_resume(saved["config"], cfg)
    listing = lambda diff: ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items())  # noqa: E731
    if changing and not args.allow_config_change:
        raise ConfigError(
            f"resuming with settings that change the training: {listing(changing)} (--allow_config_change accepts them)"
        )
    if harmless or changing:
        log.warning("resuming with changed settings: %s", listing({**harmless, **changing}))
    return saved["name"], cfg


def refuse_leftover_set_aside(run_dir: Path) -> None:
    if (run_dir / SET_ASIDE).exists():
        raise ConfigError(
            f"{run_dir / SET_ASIDE} holds an earlier run that an interrupted --overwrite set aside: move its files "
            f"back into {run_dir} to keep that run, or delete it; then start again"
        )


def resolve_run_dir(args: argparse.Namespace, name: str, dist: DistEnv) -> tuple[Path, bool]:
    """The run directory, the same on every rank, and whether an earlier run in it was set aside (--overwrite).
    A new run never reuses one that holds checkpoints."""
    if args.run_dir is not None:
        run_dir = args.run_dir
    else:
        stamp: list[Any] = [time.strftime("%Y%m%d-%H%M%S")]
        torch_dist.broadcast_object_list(stamp, src=0)  # ranks start at slightly different times
        run_dir = Path("runs") / f"{name}-{stamp[0]}"
    refuse_leftover_set_aside(run_dir)
    earlier = [name for name in RUN_FILES if (run_dir / name).exists()]
    set_aside = False
    if earlier and not args.resume:
        if not args.overwrite:
            raise ConfigError(
                f"{run_dir} holds an earlier run ({', '.join(earlier)}): --resume continues it, "
                "--overwrite deletes it, or choose another --run_dir"
            )
        torch_dist.barrier()  # every rank has looked before rank 0 moves anything
        if dist.is_main:
            (run_dir / SET_ASIDE).mkdir()
            for name in earlier:  # renames, nothing copied
                (run_dir / name).rename(run_dir / SET_ASIDE / name)
        set_aside = True
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    torch_dist.barrier()
    return run_dir, set_aside


def settle_earlier_run(run_dir: Path, new_run_started: bool) -> None:
    """--overwrite, second half: delete the earlier run set aside, or put it back where the new run failed."""
    aside = run_dir / SET_ASIDE
    if new_run_started:
        log.warning("--overwrite: deleted the earlier run in %s", run_dir)
        shutil.rmtree(aside)
        return
    for entry in aside.iterdir():
        mine = run_dir / entry.name  # what the failed start wrote (its log, its metrics)
        if mine.exists():
            shutil.rmtree(mine) if mine.is_dir() else mine.unlink()
        entry.rename(mine)
    aside.rmdir()
    log.warning("--overwrite: the new run did not start; the earlier run in %s is back as it was", run_dir)


def configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    configure_logging(rank=0)  # until this process knows its rank, errors must show
    if args.resume and args.overwrite:
        log.error("--resume continues a run and --overwrite deletes it: pass one of them")
        return 2
    stop = StopRequest()  # SIGTERM / SIGUSR1: checkpoint at the next step boundary, then exit 75
    run_dir, dist, set_aside, checks_passed = None, None, False, False
    try:
        dist = DistEnv.from_environ()
        configure_logging(dist.rank)
        name, cfg = resolve_config(args, overrides)
        device = init_distributed(dist, cfg.dist_timeout_s)
        started = {"launcher": "a launcher's variables", "slurm": "srun's variables", "single": "no launcher"}[
            dist.source
        ]
        log.info(
            "rank %d of %d (local rank %d of %d on this node), from %s",
            dist.rank,
            dist.world_size,
            dist.local_rank,
            dist.local_world_size,
            started,
        )
        run_dir, set_aside = resolve_run_dir(args, name, dist)
        if dist.is_main:
            handler = logging.FileHandler(run_dir / "train.log")
            handler.setFormatter(logging.getLogger().handlers[0].formatter)
            logging.getLogger().addHandler(handler)
            log.info("run directory %s", run_dir)
        prepare_data(cfg, dist)
        trainer = Trainer(cfg, name, dist, device, run_dir, args.resume, args.stop_after_epoch, stop)
        try:
            torch_dist.barrier()  # every rank has passed its checks
        except RuntimeError:  # a rank that stopped on bad input closed its connections
            raise DistError("another rank stopped before training started (its output says why)") from None
        checks_passed = True
        if dist.is_main:
            if set_aside:
                settle_earlier_run(run_dir, new_run_started=True)
            write_resolved_config(run_dir, name, cfg, trainer.ds_config, dist)
        summary = trainer.train()
    except USER_ERRORS as err:
        log.error("%s", err)
        return 2
    except NumericalError as err:
        log.error("%s", err)
        return DIVERGED_EXIT
    finally:
        if set_aside and dist.is_main and not checks_passed:
            settle_earlier_run(run_dir, new_run_started=False)
    return PREEMPTED_EXIT if summary["preempted"] else 0


if __name__ == "__main__":
    sys.exit(main())
