"""Rank processes forked from one server that imported torch once: `python -c CODE` without
the interpreter's start and torch's import (1.3-1.4 s of CPU a rank on the 2-core VM, about
the whole start of a benchmark rank). pyfast.netns.ranks starts its plain-loopback ranks here.

The server (`python -c "...serve()"`, started on first use and ended with this process) imports
torch and torch.distributed with one OpenMP thread, so it holds no thread pool and no gloo state
when it forks; each rank is an os.fork() of it that sets its environment, its own session, its
stderr, then runs CODE as `python -c` would (`__name__` "__main__", an exception's traceback on
stderr and exit 1, SystemExit's code). As pyfast.plan.probe_ranks (whose child this shares), not
multiprocessing's forkserver: that re-runs the caller's main script in every child. Unlike a
fresh interpreter, a rank inherits the server's imports and its libgomp settings: torch's
threads are set from the rank's OMP_NUM_THREADS explicitly (torch.set_num_threads).

Ranks() gets Popen-like handles (pid, poll, wait, returncode): the server reaps its children and
reports their exit codes (os.waitstatus_to_exitcode: -9 for a SIGKILL, as Popen says)."""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
import traceback

PRELOAD = ("torch", "torch.distributed")

_reply_fd = -1  # a server's reply stream: closed in each child


class Server:
    """A `python -c "from MODULE import serve; serve()"` process with OMP_NUM_THREADS=1 that
    answers one JSON line with one JSON line (`ask`), started on first use (again in a forked
    child of this process, or after it died) and ended with this process (EOF on its stdin)."""

    def __init__(self, module: str, what: str):
        self.module, self.what = module, what
        self._proc: subprocess.Popen | None = None
        self._owner = 0  # the pid that started _proc: a forked child of it starts its own
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        p = self._proc
        if p is None or self._owner != os.getpid() or p.poll() is not None:
            self._owner = os.getpid()
            # this process's pyfast, not whatever `-c` would find first in the working directory
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            p = self._proc = subprocess.Popen(
                [sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); "
                 f"from {self.module} import serve; serve()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            atexit.register(p.stdin.close)  # the server ends at EOF
        return p

    def ask(self, req: dict):
        with self._lock:
            srv = self._start()
            srv.stdin.write(json.dumps(req) + "\n")
            srv.stdin.flush()
            line = srv.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.what} exited ({srv.wait()})")
        return json.loads(line)


def reply_stream():
    """In a server: its own copy of stdout for the replies; fd 1 becomes stderr, so that what
    a rank prints cannot land in the reply stream. Children close it (fork)."""
    global _reply_fd
    _reply_fd = os.dup(1)
    out = os.fdopen(_reply_fd, "w")
    os.dup2(2, 1)
    return out


_SERVER = Server("pyfast._forked", "rank fork server")


class Rank:
    """A forked rank, as much of subprocess.Popen as pyfast.netns uses."""

    def __init__(self, code: str, env: dict, log: str | None):
        self.args = ["-c", code]
        self.pid = _SERVER.ask({"op": "start", "code": code, "env": env, "log": log,
                                "cwd": os.getcwd()})["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _SERVER.ask({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


def serve() -> None:
    """The server's loop: one JSON request a line on stdin, one reply a line; ends at EOF."""
    out = reply_stream()
    for name in PRELOAD:
        __import__(name)
    codes: dict[int, int] = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "start":
            reply = {"pid": fork(req["code"], req["env"], req["log"], session=True,
                                 cwd=req["cwd"])}
        else:
            pid = req["pid"]
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            reply = {"code": codes.get(pid)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def fork(code: str, env: dict, log: str | None = None, session: bool = False,
         name: str = "__main__", cwd: str | None = None) -> int:
    """Fork this process into one that runs `code` with environment `env` (stderr appended to
    `log`; its own session; in `cwd`); the child's pid. The child never returns. env's
    PYTHONPATH goes in front of sys.path, as a fresh interpreter's would."""
    pid = os.fork()
    if pid:
        return pid
    rc = 1
    try:
        if _reply_fd >= 0:
            os.close(_reply_fd)
        if session:  # killpg(pid) stops the rank and what it started, as start_new_session
            os.setsid()
        if log is not None:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND)
            os.dup2(fd, 2)
            os.close(fd)
        if cwd is not None:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["-c"]
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]  # after -c's "" (the cwd)
        import torch
        # as OMP_NUM_THREADS did for a fresh interpreter (the server's libgomp read its own;
        # every caller sets it: unset here means 1, not all cores)
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))
        exec(compile(code, "<string>", "exec"), {"__name__": name})
        rc = 0
    except SystemExit as e:
        rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1  # as Python
    except BaseException:  # noqa: BLE001  (reported as the rank's traceback and exit 1)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
