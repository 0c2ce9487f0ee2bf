"""Training throughput of any config, four ways, measured by one harness in one process per case.

    python -m bench.train --config debug --modes io synthetic full plain
    python -m deepspeed.launcher.runner --num_gpus 2 --module bench.train --config debug --modes synthetic
    srun -n 8 python -m bench.train --config bs512_opt --modes synthetic full

``io`` the pipeline alone; ``synthetic`` the engine on one batch made on the device; ``full`` the real training
step; ``plain`` the synthetic batch stepped by torch alone (Adam, DDP, autocast), so that the engine's cost is a
ratio. Rank 0 appends one record per mode to ``--out``; docs/benchmarks.md says how each is timed.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from bench.cases import rate_summary
from bench.cases import rounds as harness_rounds
from bench.env import REPO, append_records, environment
from bench.flops import model_flops, utilization
from common.cli import output_file
from common.tensors import precision_name
from model import UNetSpec
from trainer.build import EngineSetup, build_engine, build_loss, build_model, run_facts
from trainer.config import Config, build_config, config_parser, load_named, parse_config_options, to_dict
from trainer.data import RunData, build_data, prepare_data
from trainer.dist import Device, DistEnv, init_distributed
from trainer.errors import USER_ERRORS
from trainer.noise import at_step as noise_at_step
from trainer.noise import for_run as noise_for_run
from trainer.provenance import rank_hosts
from trainer.rundir import configure_logging
from trainer.step import StepGuard, clocked, phase, train_step

RESULTS = REPO / "bench" / "results" / "train.jsonl"
MODES = ("io", "synthetic", "full", "plain")
log = logging.getLogger("bench.train")


class Marks:
    """Where the phases of each timed step began and ended (``trainer.step.clocked``): CUDA events on a GPU, read
    once at the end, and the host clock on a CPU."""

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda
        self.steps: list[dict[str, list[list[Any]]]] = []

    def step(self) -> None:
        self.steps.append({})

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self, name: str) -> None:
        self.steps[-1].setdefault(name, []).append([self._now(), None])

    def end(self, name: str) -> None:
        self.steps[-1][name][-1][1] = self._now()

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else 1000 * (b - a)

    def phase_ms(self, name: str) -> list[float]:
        """Per step, the time in phase ``name``, summed over its micro-steps."""
        if self.cuda:
            torch.cuda.synchronize()
        return [sum(self._ms(a, b) for a, b in s[name]) for s in self.steps if name in s]

    def step_ms(self) -> list[float]:
        """Per step, from its first phase's beginning to the next step's (so data waits are included)."""
        if self.cuda:
            torch.cuda.synchronize()
        firsts = [next(iter(s.values()))[0][0] for s in self.steps if s]
        return [self._ms(a, b) for a, b in zip(firsts, firsts[1:], strict=False)]


def percentiles(values: list[float], prefix: str) -> dict[str, float]:
    return {
        f"{prefix}_p50": float(np.percentile(values, 50)),
        f"{prefix}_p90": float(np.percentile(values, 90)),
        f"{prefix}_p99": float(np.percentile(values, 99)),
    }


def timed(step: Callable[[], float], warmup: int, steps: int, *, cuda: bool) -> dict[str, Any]:
    """Run ``warmup`` steps untimed, then ``steps`` timed ones; ``step`` returns its seconds of data wait."""
    for _ in range(warmup):
        step()
    marks = Marks(cuda=cuda)
    if cuda:
        torch.cuda.synchronize()
    start, wait_s = time.perf_counter(), 0.0
    with clocked(marks):
        for _ in range(steps):
            marks.step()
            wait_s += step()
    marks.step()
    marks.begin("end")  # closes the last step for step_ms
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "data_wait_pct": 100 * wait_s / wall, "marks": marks}


class TrainBench:
    """One process's benchmark: the run's data and engine, built as the trainer builds them, and the four ways to
    step them."""

    def __init__(self, cfg: Config, dist: DistEnv, device: Device, *, data: RunData, setup: EngineSetup) -> None:
        self.cfg, self.dist, self.device, self.setup = cfg, dist, device, setup
        self.cuda = device.type == "cuda"
        self.engine = engine = setup.engine
        self.accumulation = engine.gradient_accumulation_steps()
        self.micro = engine.train_micro_batch_size_per_gpu()
        self.guard = StepGuard(cfg.faults, engine.device, stop=None)  # the trainer's agreement on each step, if any
        self.noise, self.pieces, said = noise_for_run(engine, asked=cfg.noise_scale)  # as the trainer measures it
        log.info("%s", said)
        self.loss_fn = build_loss(cfg)
        # the training loader only: the benchmark validates nothing
        self.train_loader = data.train_loader(
            dist, self.micro, self.accumulation, steps_per_epoch=setup.steps_per_epoch, device=device, dtype=setup.dtype
        )
        generator = torch.Generator(device=engine.device).manual_seed(cfg.seed + dist.rank)
        shape = (self.micro, cfg.data_size, cfg.data_size, cfg.data_size)
        layout = torch.channels_last_3d if data.settings.channels_last else torch.contiguous_format  # as the pipeline
        self.batch = (
            torch.randn(shape[:1] + (cfg.N_in_channels,) + shape[1:], generator=generator, device=engine.device)
            .to(setup.dtype)
            .contiguous(memory_format=layout),
            torch.randn(shape[:1] + (cfg.N_out_channels,) + shape[1:], generator=generator, device=engine.device)
            .tanh()
            .contiguous(memory_format=layout),
        )
        self.batches = self._epochs()

    def _epochs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The training loader's batches, epoch after epoch."""
        while True:
            yield from self.train_loader

    def io_step(self) -> float:
        start = time.perf_counter()
        with phase("data_wait"):
            for _ in range(self.accumulation):
                next(self.batches)
        return time.perf_counter() - start

    def engine_step(self, *, synthetic: bool) -> float:
        """The training loop's step and checks (one reduction and host sync where the config asks for them)."""
        engine = self.engine
        noise, pieces = noise_at_step(  # the trainer's measured steps
            self.noise, self.pieces, step=engine.global_steps, every=self.cfg.log_every_steps
        )
        result = train_step(
            engine,
            itertools.repeat(self.batch) if synthetic else self.batches,
            loss_fn=self.loss_fn,
            guard=self.guard,
            where=lambda index: f"step {engine.global_steps}",
            noise=noise,
            pieces=pieces,
            reduction=self.setup.reduction,
        )
        return result.data_wait_s

    def plain(self) -> Callable[[Marks], float]:
        """The same model and batch stepped by plain PyTorch: torch.optim.Adam, DDP across ranks, autocast."""
        cfg = self.cfg
        model = build_model(cfg).to(self.engine.device)
        if self.dist.world_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.cuda else None
            )
        params = self.setup.ds_config["optimizer"]["params"]
        optimizer = torch.optim.Adam(
            model.parameters(),
            lr=params["lr"],
            betas=tuple(params.get("betas", (0.9, 0.999))),
            eps=params.get("eps", 1e-8),
            weight_decay=params.get("weight_decay", 0.0),
        )
        dtype = self.setup.dtype
        device_type = self.engine.device.type
        scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
        inputs, targets = self.batch[0].float(), self.batch[1]

        def step() -> float:
            for micro in range(self.accumulation):
                with phase("forward"), torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = self.loss_fn(model(inputs), targets) / self.accumulation
                with phase("backward"):
                    scaler.scale(loss).backward()
                if micro == self.accumulation - 1:
                    with phase("optimizer_step"):
                        scaler.step(optimizer)
                        scaler.update()
                        optimizer.zero_grad(set_to_none=True)
            return 0.0

        return step

    def runs(self, modes: list[str], warmup: int, steps: int, *, rounds: int) -> dict[str, dict[str, Any]]:
        """Per mode, ``rounds`` timed runs taken in turn with the other modes, summarized in one record."""
        steppers = {
            "io": self.io_step,
            "synthetic": lambda: self.engine_step(synthetic=True),
            "full": lambda: self.engine_step(synthetic=False),
        }
        if "plain" in modes:
            steppers["plain"] = self.plain()
        results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        peak_gib: dict[str, float] = {}
        for _, mode in harness_rounds(modes, rounds):
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            results[mode].append(timed(steppers[mode], warmup, steps, cuda=self.cuda))
            peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0
            peak_gib[mode] = max(peak_gib.get(mode, 0.0), peak)
        return {mode: self._summarize(runs, steps, peak_gib[mode]) for mode, runs in results.items()}

    def _summarize(self, runs: list[dict[str, Any]], steps: int, device_peak_gib: float) -> dict[str, Any]:
        all_marks: list[Marks] = [run["marks"] for run in runs]
        step_ms = [ms for marks in all_marks for ms in marks.step_ms()]
        rates = [steps * self.engine.train_batch_size() / run["wall_s"] for run in runs]
        record: dict[str, Any] = {
            "rounds": len(runs),
            "wall_s": sum(run["wall_s"] for run in runs),
            **rate_summary(rates),
            "data_wait_pct": statistics.median(run["data_wait_pct"] for run in runs),
            **percentiles(step_ms, "step_ms"),
        }
        if "forward" in all_marks[0].steps[0]:
            for name, phase_name in {
                "forward": "forward",
                "backward": "backward",
                "optimizer": "optimizer_step",
            }.items():
                times = [ms for marks in all_marks for ms in marks.phase_ms(phase_name)]
                record[f"{name}_ms_p50"] = statistics.median(times)
            waits = [ms for marks in all_marks for ms in marks.phase_ms("reduce_wait")]  # the overlapped reduction's
            record["reduce_wait_ms_p50"] = statistics.median(waits) if waits else None
        if self.cuda:
            record.update(mem_peak_gib=device_peak_gib, mem_kind="device")
        else:
            record.update(mem_peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, mem_kind="host_rss")
        return record


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    """The harness's own options, and the training config from the config options."""
    parser = config_parser("python -m bench.train", __doc__.split("\n\n")[0], sys.argv[1:] if argv is None else argv)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["synthetic"])
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps discarded before timing")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps timed per round")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds over the modes (a, b, a, b...), so that drift falls on every mode alike",
    )
    parser.add_argument("--sweep", default="adhoc", help="name of the sweep this case belongs to")
    parser.add_argument("--run_id", default=time.strftime("%Y%m%dT%H%M%S"), help="groups the records of one sweep run")
    parser.add_argument("--case", default="", help="label of this case within its sweep")
    parser.add_argument("--repeat", type=int, default=0, help="which run of a repeated case this is")
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args, overrides = parse_config_options(parser, argv)
    # The engine's speed against the plain loop's, like for like: the noise scale's measurement (with one rank and no
    # accumulation, each micro-batch in two halves) only where asked for; its cost is a case of its own.
    overrides.setdefault("noise_scale", "false")
    return args, build_config(load_named(args.yaml_config, args.config), overrides)


def main(argv: list[str] | None = None) -> int:
    try:
        measure(argv)
    except USER_ERRORS as err:  # bad input: one line, as ds_train says it
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def measure(argv: list[str] | None) -> None:
    """Build the case from the options, time its modes, append a record per mode to --out (rank 0)."""
    args, cfg = parse_args(argv)
    dist = DistEnv.from_environ()
    configure_logging(dist.rank)
    device = init_distributed(dist, cfg.dist_timeout_s)
    prepare_data(cfg, dist)
    data = build_data(cfg, dist, device)
    setup = build_engine(cfg, dist, device)
    bench = TrainBench(cfg, dist, device, data=data, setup=setup)
    try:
        flops = model_flops(UNetSpec.from_config(to_dict(cfg)), cfg.data_size)
        env = environment()
        hosts = rank_hosts(dist.world_size)  # where the ranks ran: one node, or several
        engine = setup.engine
        # MFU is over every device the job uses: each GPU, or each node's CPU (shared by its ranks).
        devices = dist.world_size if device.type == "cuda" else dist.world_size // dist.local_world_size
        precision = precision_name(setup.dtype)
        for mode, result in bench.runs(args.modes, args.warmup, args.steps, rounds=args.rounds).items():
            record = {
                "bench": "train",
                "sweep": args.sweep,
                "run_id": args.run_id,
                "case": args.case,
                "repeat": args.repeat,
                "mode": mode,
                "engine": "plain" if mode == "plain" else "deepspeed",
                "config": args.config,
                **run_facts(setup, data, dist),
                "nodes": sorted(set(hosts)),
                "crop": cfg.data_size,
                "unet_width": cfg.unet_width,
                "unet_depth": cfg.unet_depth,
                "threads_per_rank": torch.get_num_threads(),
                "fast_paths": {
                    "channels_last": data.settings.channels_last,
                    "cudnn_benchmark": torch.backends.cudnn.benchmark,
                    # algorithms timed per shape (0: all); torch's own where not set
                    "cudnn_benchmark_limit": (
                        torch.backends.cudnn.benchmark_limit if torch.backends.cudnn.benchmark else None
                    ),
                    "pad_last_layer": cfg.pad_last_layer,
                    "compile": cfg.compile,
                    "compile_mode": cfg.compile_mode,
                    "nonfinite_loss": cfg.nonfinite_loss,
                    "gradient_reduction": cfg.gradient_reduction if setup.reduction is not None else "deepspeed",
                    "reduce_bucket_mb": cfg.reduce_bucket_mb if setup.reduction is not None else None,
                    "noise_scale": bench.noise is not None,
                    "noise_pieces": bench.pieces,  # 2: each micro-batch split in two for the noise scale
                },
                "zero": setup.ds_config.get("zero_optimization", {}),
                "optimizer": "Adam" if mode == "plain" else type(engine.basic_optimizer).__name__,  # plain: torch's
                "warmup_steps": args.warmup,
                "timed_steps": args.steps,
                **result,
                **flops,
                **(
                    utilization(result["samples_per_s"], flops, env["device"], precision=precision, devices=devices)
                    if mode != "io"
                    else {}
                ),
                **env,
            }
            if dist.is_main:
                append_records(args.out, [record])
                log.info(
                    "%s %s: %.1f samples/s, step p50 %.1f ms",
                    args.case or args.config,
                    mode,
                    record["samples_per_s"],
                    record["step_ms_p50"],
                )
        torch_dist.barrier()
    finally:
        bench.train_loader.close()


if __name__ == "__main__":
    sys.exit(main())
