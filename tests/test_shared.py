"""One copy per node (pipeline/shared.py), with real processes: two ranks of a gloo group share one segment that the
first fills; the machine's shared memory grows by one copy, not two; nothing is left in /dev/shm, even by a rank
killed while filling, once the next start has reclaimed it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pipeline.shared import PREFIX, SHM, Node, reclaim_stale, shared_array
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm here")

# argv: rank, port, key, MiB. Fills (rank 0) a float32 array of MiB with its indices, reports what it saw.
RANK = """
import json, os, sys, datetime
import numpy as np
import torch, torch.distributed as dist
from pipeline.shared import Node, shared_array

rank, port, key, mib = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)

def agree(*, failed):
    flag = torch.tensor([float(failed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())

def shmem():
    return int(next(l for l in open("/proc/meminfo") if l.startswith("Shmem:")).split()[1]) * 1024

filled = []
def fill(out):
    filled.append(1)
    out[...] = np.arange(out.size, dtype=np.float32).reshape(out.shape)

before = shmem()
agree(failed=False)
node = Node(local_rank=rank, local_ranks=2, agree=agree, key=key)
array = shared_array(node, "box", shape=(mib, 256, 1024), fill=fill)
agree(failed=False)
grown = shmem() - before
ok = bool((array.reshape(-1)[:: 997] == np.arange(array.size, dtype=np.float32)[:: 997]).all())
left = [p for p in os.listdir("/dev/shm") if key in p]
seen = {"filled": len(filled), "equal": ok, "grown": grown, "left": left, "writeable": array.flags.writeable}
print(json.dumps(seen))
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_ranks_of_a_node_share_one_copy_that_the_first_fills():
    key, port, mib = f"test-{os.getpid()}", _port(), 64
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(port), key, str(mib)], env=env, stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    seen = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in ranks]
    assert [s["filled"] for s in seen] == [1, 0]  # read once, by the first rank
    assert all(s["equal"] and not s["writeable"] for s in seen)
    assert all(s["left"] == [] for s in seen)  # its name gone while both ranks still map it
    copy = mib * 2**20
    assert 0.9 * copy < max(s["grown"] for s in seen) < 1.3 * copy  # the machine holds one copy, not two


def test_one_process_is_a_node_of_one():
    array = shared_array(Node(), "solo", shape=(2, 3), fill=lambda out: out.__setitem__(..., 7.0))
    assert (array == 7.0).all() and not list(SHM.glob(f"{PREFIX}*solo"))


def test_a_copy_left_by_a_run_killed_while_filling_it_is_reclaimed_and_a_live_one_is_not():
    fills_forever = (
        "import sys, time; from pipeline.shared import Node, shared_array; "
        "shared_array(Node(key=sys.argv[1]), 'box', shape=(1024,), fill=lambda out: (print('filling', flush=True), "
        "time.sleep(60)))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", fills_forever, f"test-{name}-{os.getpid()}"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("killed", "live")
    }
    try:
        for proc in procs.values():
            assert proc.stdout.readline() == "filling\n"
        procs["killed"].send_signal(signal.SIGKILL)
        procs["killed"].wait()
        host = socket.gethostname()
        killed, live = (SHM / f"{PREFIX}test-{name}-{os.getpid()}-{host}-box" for name in ("killed", "live"))
        assert killed.exists() and live.exists()  # what SIGKILL leaves
        assert reclaim_stale([PREFIX]) == [killed]
        assert not killed.exists() and live.exists()  # a run still filling its copy keeps it
    finally:
        procs["live"].kill()
        procs["live"].wait()
    time.sleep(0.1)
    assert reclaim_stale([PREFIX]) == [live]


def test_a_copy_that_does_not_fit_is_one_line_before_anything_is_written():
    free = os.statvfs(SHM)
    too_big = (free.f_bavail * free.f_frsize) // 4 + 2**20
    with pytest.raises(OSError, match=r"do not fit in /dev/shm .*: use storage 'lazy', or enlarge /dev/shm"):
        shared_array(Node(), "huge", shape=(too_big,), fill=lambda out: None)
    assert not list(SHM.glob(f"{PREFIX}*huge"))
