"""Two nodes on one machine, joined by a link shaped like a cluster's: two network namespaces, a veth pair between
them, ``tc ... tbf`` on both ends (rate, burst, queue latency), each node with a host name of its own (``unshare
--uts``); the ranks of a command run one per node, env-style (RANK, WORLD_SIZE, MASTER_ADDR), gloo bound to the veth.

    python -m bench.link --rate_mbit 400 check    # it carries, and an all-reduce takes bytes / rate
    python -m bench.link --rate_mbit 400 run -- python -m bench.train --config debug --modes synthetic

Root only. Traffic goes only between the namespaces made here; they are removed however the run ends. A machine whose
veth carries nothing (a gVisor sandbox) is said in one line (exit 3). ``tbf`` shapes the rate; this kernel has no
``netem`` to add delay (``latency`` is tbf's queue limit).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from common.cli import ArgumentParser

SUBNET = "10.231.{}.{}"  # a private /24 of the namespaces only
PREFIX = "cosmo-link-"  # the namespaces' names: the prefix, the making process's pid, two random hex digits, -1 or -2
PORT = 29411
NOT_HERE = 3  # exit status where the machine cannot make the link


class LinkError(RuntimeError):
    """The link cannot be made or carries nothing here."""


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What ``tbf`` does on each end: the rate, the burst it lets through at once, the longest a packet queues."""

    rate_mbit: float | None  # None: unshaped (the veth's own speed)
    burst_kib: int = 256  # above a GSO packet (64 KiB), or the rate falls short of the one set
    latency_ms: float = 50.0

    def tc(self, device: str) -> list[str] | None:
        if self.rate_mbit is None:
            return None
        rate = f"{self.rate_mbit:g}mbit"
        return ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", f"{self.burst_kib}kb"] + [
            "latency",
            f"{self.latency_ms:g}ms",
        ]


@dataclass(frozen=True, kw_only=True)
class Link:
    """Two namespaces with a veth between them: node ``i`` is ``namespaces[i]`` at ``addresses[i]`` on ``devices[i]``,
    named ``hosts[i]``."""

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]
    hosts: tuple[str, str]
    shape: Shape

    def command(self, node: int, argv: Sequence[str], env: dict[str, str]) -> list[str]:
        """``argv`` run on ``node``: in its namespace, under its host name, with ``env`` set."""
        assignments = [f"{k}={v}" for k, v in env.items()]
        inner = ["env", *assignments, *argv]
        named = ["unshare", "--uts", "sh", "-c", f'hostname {self.hosts[node]} && exec "$@"', "sh", *inner]
        return ["ip", "netns", "exec", self.namespaces[node], *named]


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LinkError(f"{' '.join(argv)}: {(result.stderr or result.stdout).strip()}")


def _missing_tools() -> list[str]:
    return [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]


@contextlib.contextmanager
def made(shape: Shape) -> Iterator[Link]:
    """The link, for the block's duration; removed on the way out, whatever ended the block."""
    if os.geteuid() != 0:
        raise LinkError("making network namespaces needs root")
    if missing := _missing_tools():
        raise LinkError(f"{', '.join(missing)} not found (Debian's iproute2 and util-linux)")
    reclaim_stale()
    tag = f"{os.getpid() % 10**6}{uuid.uuid4().hex[:2]}"
    subnet = int(tag[-2:], 16) % 200 + 20
    link = Link(
        namespaces=(f"{PREFIX}{tag}-1", f"{PREFIX}{tag}-2"),
        devices=(f"ve{tag}a", f"ve{tag}b"),
        addresses=(SUBNET.format(subnet, 1), SUBNET.format(subnet, 2)),
        hosts=("node1", "node2"),
        shape=shape,
    )
    try:
        for ns in link.namespaces:
            _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", link.devices[0], "type", "veth", "peer", "name", link.devices[1]])
        for ns, device, address in zip(link.namespaces, link.devices, link.addresses, strict=True):
            _run(["ip", "link", "set", device, "netns", ns])
            inside = ["ip", "netns", "exec", ns]
            _run([*inside, "ip", "addr", "add", f"{address}/24", "dev", device])
            _run([*inside, "ip", "link", "set", device, "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
            if tc := shape.tc(device):
                _run([*inside, *tc])
        yield link
    finally:
        subprocess.run(["ip", "link", "delete", link.devices[0]], capture_output=True, timeout=30)  # if not moved
        for ns in link.namespaces:  # removing a namespace removes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


def reclaim_stale() -> None:
    """Namespaces this module made for a process that is gone (killed before it could remove them), removed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX)):
        pid = int(name.removeprefix(PREFIX)[:-4])
        if not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
            print(f"removed network namespace {name}, left by process {pid}", file=sys.stderr)


def ranks_env(link: Link, node: int, *, port: int = PORT) -> dict[str, str]:
    """The environment of the rank on ``node``: one rank per node, rank 0 on the first, gloo on the veth."""
    return {
        "RANK": str(node),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": link.addresses[0],
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": link.devices[node],
        "CUDA_VISIBLE_DEVICES": "",  # gloo over the veth: on a GPU host, NCCL would find its own way
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.getcwd(),
    }


def run_ranks(link: Link, argv: Sequence[str], *, timeout_s: float) -> list[subprocess.CompletedProcess]:
    """``argv`` as two ranks, one on each node; both killed past ``timeout_s`` (their output kept)."""
    procs = [
        subprocess.Popen(
            link.command(node, argv, ranks_env(link, node)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    deadline, results = time.monotonic() + timeout_s, []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                out, err = proc.communicate()
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


CHECK = """
import json, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
tensor = torch.ones(int(sys.argv[1]) // 4)
dist.all_reduce(tensor)  # the connections made
times = []
for _ in range(int(sys.argv[2])):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor)
    times.append(time.perf_counter() - start)
if dist.get_rank() == 0:
    print(json.dumps({"bytes": tensor.numel() * 4, "seconds": sorted(times)[len(times) // 2]}))
dist.destroy_process_group()
"""


def carries(link: Link, *, timeout_s: float = 20.0) -> bool:
    """Whether a connection crosses the link: a one-second socket test, node 2 to node 1."""
    server = ["python3", "-c", "import socket; s = socket.create_server(('', 29410)); s.settimeout(15); s.accept()"]
    client = f"import socket, time; time.sleep(1); socket.create_connection(('{link.addresses[0]}', 29410), timeout=5)"
    listening = subprocess.Popen(link.command(0, server, {}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        connected = subprocess.run(
            link.command(1, ["python3", "-c", client], {}), capture_output=True, timeout=timeout_s
        )
        return connected.returncode == 0 and listening.wait(timeout=timeout_s) == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        if listening.poll() is None:
            listening.kill()
            listening.wait()


def check(link: Link, *, nbytes: int = 64 * 2**20, repeats: int = 3) -> dict[str, float]:
    """An all-reduce of ``nbytes`` over the link by the two ranks (ring: each sends and receives half the bytes twice,
    ``nbytes`` each way in all): its median time, and the time bytes / rate says it takes."""
    results = run_ranks(link, [sys.executable, "-c", CHECK, str(nbytes), str(repeats)], timeout_s=300)
    for result in results:
        if result.returncode != 0:
            raise LinkError(f"the all-reduce over the link failed: {result.stderr.strip().splitlines()[-1:]}")
    import json

    measured = json.loads(results[0].stdout.strip().splitlines()[-1])
    expected = nbytes * 8 / (link.shape.rate_mbit * 1e6) if link.shape.rate_mbit else None
    return {"bytes": measured["bytes"], "seconds": measured["seconds"], "expected_seconds": expected}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench.link", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate_mbit", type=float, help="the link's rate (default: unshaped)")
    parser.add_argument("--burst_kib", type=int, default=256)
    parser.add_argument("--latency_ms", type=float, default=50.0, help="tbf's queue limit")
    parser.add_argument("--timeout_s", type=float, default=1800.0)
    parser.add_argument("what", choices=["check", "run"])
    parser.add_argument("command", nargs="*", help="with run: the command each rank runs (after --)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the namespaces removed on the way out
    shape = Shape(rate_mbit=args.rate_mbit, burst_kib=args.burst_kib, latency_ms=args.latency_ms)
    try:
        with made(shape) as link:
            if not carries(link):
                raise LinkError("a veth pair between two network namespaces carries nothing on this machine")
            if args.what == "check":
                print(check(link))
                return 0
            results = run_ranks(link, args.command, timeout_s=args.timeout_s)
            for node, result in enumerate(results):
                print(
                    f"--- rank {node} on {link.hosts[node]} (exit {result.returncode})\n{result.stdout}{result.stderr}"
                )
            return max(abs(r.returncode) for r in results)
    except LinkError as err:
        print(f"python -m bench.link: {err}", file=sys.stderr)
        return NOT_HERE


if __name__ == "__main__":
    sys.exit(main())
