"""bench.link: two "nodes" joined by a shaped veth pair carry an all-reduce at the rate set, under their own host
names, and leave nothing behind; a machine where that cannot be made is said in one line."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from bench.link import PREFIX, Shape, carries, check, made


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX)]


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "unshare")),
    reason="network namespaces need root and iproute2",
)


@needs_root
def test_an_all_reduce_over_the_shaped_link_takes_bytes_over_rate_and_nothing_is_left():
    with made(Shape(rate_mbit=400)) as link:
        if not carries(link):
            pytest.skip("a veth pair between two network namespaces carries nothing on this machine")
        measured = check(link, nbytes=16 * 2**20, repeats=3)
        hosts = subprocess.run(link.command(1, ["hostname"], {}), capture_output=True, text=True, timeout=30).stdout
        assert set(link.namespaces) <= set(_namespaces())
    assert measured["seconds"] == pytest.approx(measured["expected_seconds"], rel=0.25)
    assert hosts.strip() == "node2"
    assert not set(link.namespaces) & set(_namespaces())  # removed on the way out


@needs_root
def test_the_namespaces_go_however_the_block_ends_and_a_dead_runs_are_reclaimed():
    stale = f"{PREFIX}99999999ab-1"  # as a process that no longer exists would have left it
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    made_here = []
    with pytest.raises(RuntimeError, match="the block failed"), made(Shape(rate_mbit=None)) as link:
        made_here = list(link.namespaces)
        assert stale not in _namespaces()  # reclaimed before this link was made
        raise RuntimeError("the block failed")
    assert made_here and not set(made_here) & set(_namespaces())
