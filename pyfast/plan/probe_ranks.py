"""The planner's probe ranks (pyfast.plan.calibrate_*): `world` processes of one gloo group on
loopback, forked from one server process that imported torch and the probes once.

Why a fork server and not `python -c` per probe: `calibrate.measure` starts 4-6 probes of 1-2
ranks each, and each fresh interpreter spent its first seconds importing torch (2-4 s a process
on this 2-core VM on a good day, 13-22 s on 2026-11-29 when its page faults were slow), longer
than most probes run. The server (`python -c "...serve()"`, started on the first probe and
ended with this process) imports PRELOAD once with one OpenMP thread, so it holds no thread
pool and no gloo state when it forks; each rank is an os.fork() of it that makes its process
group after the fork: a fresh process as far as the probe can tell. Not multiprocessing's
forkserver: that re-runs the caller's main script in every child (a library call from an
unguarded script would recurse). The shaped-link probe (calibrate_link.probe_link) still starts
fresh interpreters: they must start inside the network namespace.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from pyfast._forked import Server, fork, reply_stream

PRELOAD = ("torch", "torch.distributed", "pyfast.plan.calibrate_link",
           "pyfast.plan.calibrate_dist", "pyfast.plan.calibrate_compute",
           "pyfast.plan.calibrate_job", "pyfast.train.job")

_SERVER = Server("pyfast.plan.probe_ranks", "probe server")


def run(code: str, world: int, timeout: float) -> list[int | None]:
    """Python source `code` run as ranks 0..world-1 of one gloo group (env://: RANK,
    WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK set, one torch thread each) in this process's
    environment; each rank's exit code (None: still running at `timeout`, then killed). A
    rank's exception prints its traceback to stderr and exits 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    return _SERVER.ask({"code": code, "world": world, "timeout": timeout, "env": env})


def serve() -> None:
    """The server's loop: one JSON request a line on stdin, its ranks' exit codes a line on
    stdout; ends at EOF."""
    out = reply_stream()
    for name in PRELOAD:
        __import__(name)
    for line in sys.stdin:
        req = json.loads(line)
        # each rank in a session of its own, as the job's ranks run (launch.forked_rank: Linux
        # schedules a session as one group; sharing one slowed gpt-tiny's pp2 steps 20-30%)
        pids = [fork(req["code"], {**req["env"], "RANK": str(r), "LOCAL_RANK": str(r)},
                     session=True, name="__pyfast_probe__")
                for r in range(req["world"])]
        out.write(json.dumps(_reap(pids, req["timeout"])) + "\n")
        out.flush()


def _reap(pids: list[int], timeout: float) -> list[int | None]:
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = None
    return [codes[p] for p in pids]
