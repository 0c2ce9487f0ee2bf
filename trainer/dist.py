"""Where this process stands in the job: rank, local rank, world size and the rendezvous address."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistError(ValueError):
    """Contradictory or incomplete distributed settings; the message names the variables."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        """From a launcher's variables (deepspeed, torchrun), or a single process when none is set."""
        present = [v for v in _LAUNCHER_VARS if v in environ]
        if not present:
            return cls(0, 0, 1, 1, "127.0.0.1", _free_port())
        missing = [v for v in _LAUNCHER_VARS if v not in environ]
        if missing:
            raise DistError(f"launcher variables incomplete: {', '.join(present)} set but {', '.join(missing)} missing")
        try:
            values = {v: int(environ[v]) for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
        except ValueError:
            raise DistError(
                "RANK, LOCAL_RANK, WORLD_SIZE and MASTER_PORT must be integers, got "
                + ", ".join(f"{v}={environ[v]!r}" for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"))
            ) from None
        # torchrun names it LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
        local_world = int(environ.get("LOCAL_WORLD_SIZE", environ.get("LOCAL_SIZE", values["WORLD_SIZE"])))
        env = cls(
            rank=values["RANK"],
            local_rank=values["LOCAL_RANK"],
            world_size=values["WORLD_SIZE"],
            local_world_size=local_world,
            master_addr=environ["MASTER_ADDR"],
            master_port=values["MASTER_PORT"],
        )
        if not 0 <= env.rank < env.world_size or not 0 <= env.local_rank < env.local_world_size:
            raise DistError(
                f"inconsistent ranks: RANK={env.rank} LOCAL_RANK={env.local_rank} WORLD_SIZE={env.world_size} "
                f"local world size {env.local_world_size}"
            )
        return env

    def export(self) -> None:
        """Put the rendezvous in the environment, where torch.distributed's env:// init reads it."""
        os.environ.update(
            RANK=str(self.rank),
            LOCAL_RANK=str(self.local_rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )
