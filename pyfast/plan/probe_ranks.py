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

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from pyfast._forked import fork

PRELOAD = ("torch", "torch.distributed", "pyfast.plan.calibrate_link",
           "pyfast.plan.calibrate_dist", "pyfast.plan.calibrate_compute",
           "pyfast.plan.calibrate_job", "pyfast.train.job")

_server: subprocess.Popen | None = None
_owner = 0  # the pid that started _server: a forked child of it starts its own
_lock = threading.Lock()


def _start() -> subprocess.Popen:
    global _server, _owner
    if _server is None or _owner != os.getpid() or _server.poll() is not None:
        _owner = os.getpid()
        # this process's pyfast, not whatever `-c` would find first in the working directory
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        _server = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); "
             "from pyfast.plan.probe_ranks import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        atexit.register(_server.stdin.close)  # the server ends at EOF
    return _server


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
    with _lock:
        srv = _start()
        srv.stdin.write(json.dumps({"code": code, "world": world, "timeout": timeout,
                                    "env": env}) + "\n")
        srv.stdin.flush()
        line = srv.stdout.readline()
    if not line:
        raise RuntimeError(f"the probe server exited ({srv.wait()})")
    return json.loads(line)


def serve() -> None:
    """The server's loop: one JSON request a line on stdin, its ranks' exit codes a line on
    stdout; ends at EOF."""
    # the replies get their own copy of stdout; fd 1 becomes stderr, so that what a probe
    # prints cannot land in the reply stream
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in PRELOAD:
        __import__(name)
    for line in sys.stdin:
        req = json.loads(line)
        pids = [_fork(req["code"], {**req["env"], "RANK": str(r), "LOCAL_RANK": str(r)})
                for r in range(req["world"])]
        out.write(json.dumps(_reap(pids, req["timeout"])) + "\n")
        out.flush()


def _fork(code: str, env: dict) -> int:
    return fork(code, env, name="__pyfast_probe__")


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
