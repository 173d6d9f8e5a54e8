"""`pyfast train --nproc N`'s ranks forked from a preloaded server (pyfast.train.launch,
--start-method forkserver, the default): the rank's environment, the server touching no CUDA,
a refused launch ending the server it started, and a forked rank's title, death and cleanup.
Training through both start methods, bitwise alike: tests/test_train.py
(test_two_nodes_on_one_machine: node 0 forked, node 1 exec'd)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from pyfast.benchmarks.ft import _children, _rank_pid
from pyfast.train.launch import rank_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_forked_ranks_environment_is_the_launchers_plus_the_agents():
    start = {"PATH": "/bin", "STALE": "server", "OMP_NUM_THREADS": "1", "KEEP": "same"}
    now = {**start, "RANK": "1", "MASTER_PORT": "29511", "OMP_NUM_THREADS": "2"}
    launcher = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "KEEP": "same", "NEW": "x"}
    got = rank_env(launcher, now, start)
    # the agent's variables (set in the rank, differing from the server's start) win; the
    # server's stale STALE is gone, as in an exec'd rank; the launcher's PATH and NEW reach it
    assert got == {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2", "KEEP": "same", "NEW": "x",
                   "RANK": "1", "MASTER_PORT": "29511"}


def test_the_servers_import_touches_no_cuda():
    """A rank forked after the server initialised CUDA could not use its GPU ("Cannot
    re-initialize CUDA in forked subprocess"): importing the server's modules must call none
    of torch.cuda's entry points. On this CPU torch they would all answer; each raises here."""
    code = """
import torch, torch.cuda
calls = []
def refuse(name):
    def f(*a, **k):
        calls.append(name)
        raise RuntimeError(f"torch.cuda.{name} called at import")
    return f
for name in ("is_available", "device_count", "_lazy_init", "init", "current_device",
             "get_device_properties", "mem_get_info", "set_device"):
    setattr(torch.cuda, name, refuse(name))
torch._C._cuda_getDeviceCount = refuse("_C._cuda_getDeviceCount")
import importlib
from pyfast.train.launch import PRELOAD
for m in PRELOAD:
    importlib.import_module(m)
assert not calls, calls
assert not torch.cuda.is_initialized()
print("ok", PRELOAD)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0 and "ok ['pyfast.train.run']" in p.stdout, p.stderr[-3000:]


def test_a_launch_refused_after_the_server_started_ends_that_server(tmp_path):
    """check() (the model's directory here) runs after the server starts, so that their two
    imports of torch overlap: a refusal there kills the server instead of leaving it importing."""
    code = f"""
import os, sys
import multiprocessing.forkserver as fs
from pyfast.train import main
rc = main(["--nproc", "2", "--dp", "2", "--model", "hf:{tmp_path}/none", "--out", "{tmp_path}/r"])
assert rc == 2 and fs._forkserver._forkserver_pid is None  # stopped, its state reset
# a later launch in this process starts a server of its own (a stale pid made it fail)
from pyfast.train.launch import _start_forkserver, _stop_forkserver
pid = _start_forkserver(2)
assert pid and os.path.exists("/proc/%d" % pid), pid
_stop_forkserver(pid)
assert not os.path.exists("/proc/%d" % pid)
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "no such directory" in p.stderr or "does not exist" in p.stderr, p.stderr[-2000:]


def test_the_command_leaves_after_atexit_and_flushed_output():
    """pyfast.cli.leave: the `pyfast train` command's exit without torch's teardown still runs
    the atexit handlers and writes everything buffered, and exits with the code."""
    code = """
import atexit, sys
from pyfast.cli import leave
atexit.register(lambda: print("handler ran", file=sys.stderr))
sys.stdout.write("x" * 200000)  # more than a pipe's buffer: written at the flush
leave(5)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 5 and p.stdout == "x" * 200000 and "handler ran" in p.stderr, \
        (p.returncode, len(p.stdout), p.stderr[-2000:])


@pytest.mark.dist
def test_forked_ranks_name_themselves_and_die_with_a_killed_launcher(tmp_path):
    """The ranks' titles name rank, world and the run's flags (their cmdline is otherwise the
    server's). A SIGKILLed launcher takes its server and ranks with it: multiprocessing hands
    each forked rank the server's "alive" pipe, which kept all three alive, training, before
    the ranks closed it (an exec'd rank outlives it too). Each rank has a session of its own.
    """
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "pyfast", "train", "--nproc", "2", "--dp", "2", "--model",
           "gpt-tiny", "--seq", "16", "--batch", "4", "--steps", "100000", "--ckpt-every",
           "100000", "--tensorboard", "off", "--out", out]
    # OMP_NUM_THREADS first in the launcher's environment, which torchrun's agent sets in each
    # rank: the case in which the titles were lost (launch._start_forkserver)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={"OMP_NUM_THREADS": "1", **os.environ})
    try:
        t0 = time.monotonic()
        while not os.path.exists(os.path.join(out, "metrics.jsonl")):
            assert p.poll() is None and time.monotonic() - t0 < 300, "the run did not start"
            time.sleep(0.1)
        tree = _children(p.pid)
        for r in (0, 1):
            pid = _rank_pid(p.pid, r)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().rstrip(b"\0").decode()
            with open(f"/proc/{pid}/comm") as f:
                assert f.read().strip() == f"pyfast rank {r}"
            assert title.startswith(f"pyfast rank {r}/2: train ") and f"--out {out}" in title
            # a session of its own, as an exec'd rank: Linux's autogroup schedules a session as
            # one entity (sharing the launcher's slowed gpt-tiny's pp2 steps 20-30%)
            assert os.getsid(pid) == pid != os.getsid(p.pid)
        assert len(tree) >= 3, tree  # the server and the two ranks (+ the resource tracker)
    finally:
        p.kill()
        p.wait()

    def alive():  # not yet reaped zombies are dead
        def running(q):
            try:
                with open(f"/proc/{q}/stat") as f:
                    return f.read().rsplit(") ", 1)[1][0] != "Z"
            except OSError:
                return False
        return [q for q in tree if running(q)]
    t0 = time.monotonic()
    while alive() and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    assert not alive(), alive()
