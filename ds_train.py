"""Train the cosmology emulator U-Net through a DeepSpeed engine, fed by DALI.

    python ds_train.py --config debug                      # built-in config, synthetic data
    python ds_train.py --config base --num_epochs 3 --lr_schedule.start_lr 1e-3
    python ds_train.py --run_dir runs/debug-20261202-120000 --resume
    deepspeed --num_gpus 4 ds_train.py --config bs256_opt

Every config key is an option (--key value, dotted for nested keys); see --help. Exit status: 0 done, 2 bad input
(config, data, environment, checkpoint), 3 training diverged, 75 stopped on request after a checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch.distributed as torch_dist

from common.cli import output_dir
from trainer.config import build_config, config_parser, load_named, parse_config_options, resumed_config
from trainer.data import prepare_data
from trainer.dist import DistEnv, init_distributed
from trainer.errors import USER_ERRORS, NumericalError
from trainer.preemption import PREEMPTED_EXIT, StopRequest
from trainer.rundir import RunDir, configure_logging, data_files, saved_config
from trainer.trainer import Trainer

log = logging.getLogger("ds_train")
DIVERGED_EXIT = 3


SWITCHES = {
    "--resume": "continue the run in --run_dir from its newest intact checkpoint",
    "--overwrite": "start afresh in a --run_dir that holds a run, deleting it",
    "--allow_config_change": "with --resume: accept settings that change the training",
    "--beside": "write into a --run_dir that holds files of the user's (never replacing them)",
    "--profile": "record a torch.profiler trace of a few steps into RUN_DIR/profile",
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    """Fixed options, plus every config key as an override (returned as dotted key -> raw value)."""
    usage = "%(prog)s [--config NAME] [--run_dir DIR] [--resume | --overwrite] [--KEY VALUE ...]"
    parser = config_parser("ds_train.py", __doc__.split("\n\n")[0], sys.argv[1:] if argv is None else argv, usage=usage)
    parser.add_argument(
        "--run_dir",
        type=output_dir,
        help="run directory (default: runs/<config>-<date>-<time>[-<Slurm job id>], a new one)",
    )
    for switch, what in SWITCHES.items():
        parser.add_argument(switch, action="store_true", help=what)
    parser.add_argument("--stop_after_epoch", type=int, help="stop after this epoch; the schedule spans num_epochs")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return parse_config_options(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    configure_logging(rank=0)  # until this process knows its rank, errors must show
    if args.resume and args.overwrite:
        log.error("--resume continues a run and --overwrite deletes it: pass one of them")
        return 2
    stop = StopRequest()  # SIGTERM / SIGUSR1: checkpoint at the next step boundary, then exit 75
    run = trainer = None
    try:
        dist = DistEnv.from_environ()
        configure_logging(dist.rank)
        if args.resume:
            name, cfg = resumed_config(saved_config(args.run_dir), overrides, allow_change=args.allow_config_change)
        else:
            name, cfg = args.config, build_config(load_named(args.yaml_config, args.config), overrides)
        device = init_distributed(dist, cfg.dist_timeout_s)
        run = RunDir.claim(
            args.run_dir,
            name,
            dist,
            resume=args.resume,
            overwrite=args.overwrite,
            beside=args.beside,
            inputs=data_files(cfg),
        )
        prepare_data(cfg, dist)
        trainer = Trainer(
            cfg=cfg,
            name=name,
            dist=dist,
            device=device,
            run=run,
            resume=args.resume,
            stop_after_epoch=args.stop_after_epoch,
            stop=stop,
            profile=args.profile,
        )
        trainer.wait_for_every_rank()
        run.start(name, cfg, trainer.ds_config)
        summary = trainer.train()
    except USER_ERRORS as err:
        log.error("%s", err)
        return 2
    except NumericalError as err:
        log.error("%s", err)
        return DIVERGED_EXIT
    except OSError as err:  # a run record that cannot be written (a full disk, a file size limit...): one line
        where = f"{err.filename}: " if err.filename else ""
        log.error("%s%s", where, err.strerror or " ".join(str(err).split()))
        return 2
    finally:
        if run is not None:
            run.close()  # an earlier run set aside by --overwrite goes back where this one did not start; the hold goes
        if trainer is not None:
            trainer.close()
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
    return PREEMPTED_EXIT if summary["preempted"] else 0


if __name__ == "__main__":
    sys.exit(main())
