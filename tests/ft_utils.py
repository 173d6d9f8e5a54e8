"""Shared helpers for the torchft tests: a real lighthouse, replica groups as RankPools.

A replica group is a RankPool of its own (its own TCPStore: torchft's manager and its per-quorum
stores live there, as under torchrun's MASTER_ADDR / MASTER_PORT), so N groups are N pools
whose jobs are submitted together and waited for together. The lighthouse is torchft's Rust
server run in this process (torchft._torchft.LighthouseServer, what `torchft_lighthouse` runs).
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from dist_utils import RankPool


@contextlib.contextmanager
def lighthouse(min_replicas: int, join_timeout_ms: int = 2000, heartbeat_timeout_ms: int = 1000):
    """A lighthouse on a port the OS picks; yields its "http://HOST:PORT". heartbeat_timeout_ms:
    how soon a dead group leaves the quorum (torchft's default 5000 would hold every survivor's
    next quorum 5 s); join_timeout_ms: how long a quorum waits for a heartbeating group to ask."""
    from torchft._torchft import LighthouseServer
    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                              join_timeout_ms=join_timeout_ms, quorum_tick_ms=20,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    try:
        yield server.address()
    finally:
        server.shutdown()


def group_env(port: int) -> None:
    """In a rank: the replica group's rendezvous store for torchft's Manager (torchrun sets
    MASTER_ADDR / MASTER_PORT; a RankPool's store is the test process's, at `port`)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)


def store_port(pool: RankPool) -> int:
    return pool._store.port


def coordination_store():
    """A TCPStore hosted here for what the groups tell each other outside torchft (a restarted
    group says it is up, so the survivors do not run out of steps before it joins)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def run_groups(pools: list[RankPool], fn, args: list[tuple], timeout: float = 60.0,
               expect_errors: bool = False) -> list[list]:
    """fn(rank, world, *args[g]) on every rank of every group g, all at once; per group, its
    ranks' values (RankError in place of a rank that died, with expect_errors)."""
    for pool, a in zip(pools, args):
        pool.submit(fn, *a)
    return [pool.wait(timeout, expect_errors) for pool in pools]


def equal(a, b) -> bool:
    """Bitwise equality of nested states (tensors, dicts, lists): what a healed group must hold."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b
