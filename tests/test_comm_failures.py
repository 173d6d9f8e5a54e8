"""Failures never hang: a dead peer or a silent one makes every other rank raise CommError,
naming the operation, within seconds, through comm.all_reduce (every compressor; sync, async
and reference paths) and the native engine's jobs; a broken engine refuses later jobs and
close() still returns.

Each case needs a fresh victim (a SIGKILLed rank cannot come back), so the ranks are forked
from a forkserver that has imported torch and pyfast once (RankPool's start_method): a case's
three ranks start in well under a second, where spawning three would take ~3-9 s each on this
2-core machine.
"""
import datetime
import os
import time

import pytest
import torch

import pyfast.compress as C
from dist_utils import RankError, RankPool
from pyfast.comm.collectives import choose

PG_TIMEOUT = 60.0  # the default group's timeout, never reached below
USER_TIMEOUT = 5.0  # timeout= of the groups the loops run on
FAMILIES = [  # (spec, algorithm, path)
    ("none", None, "sync"), ("fp16", "allgather", "async"), ("bf16", "two-phase", "reference"),
    ("int8", "two-phase", "sync"), ("int4", "allgather", "async"), ("fp8", "two-phase", "sync"),
    ("sign", "allgather", "reference"), ("topk:0.01", None, "sync"),
    ("randomk:0.1", None, "async"), ("powersgd:2", None, "sync"),
    ("int8", "two-phase", "engine"), ("none", None, "engine")]
BATCH = 12  # cases at once: 12 kills took 16-19 s so, 28 s one by one (2 cores, loaded)
PRELOAD = ["pyfast.comm", "pyfast.comm.engine"]  # imported once by the forkserver


def _ranks(fn, *args, world=3):
    """fn(rank, world, *args) started at once on `world` fresh ranks; wait() collects it."""
    pool = RankPool(world, PG_TIMEOUT, start_method="forkserver", preload=PRELOAD)
    pool.submit(fn, *args)
    return pool


def _collect(pool, timeout=60.0, dead=()) -> dict:
    """{rank: value or RankError} of the ranks not in `dead`, which must have been SIGKILLed."""
    try:
        got = dict(enumerate(pool.wait(timeout, expect_errors=True)))
    finally:
        pool.close()
    for r in dead:
        e = got.pop(r)
        assert isinstance(e, RankError) and e.kind == "died" and e.message == "exit code -9", \
            f"rank {r} should have been SIGKILLed: {e}"
    return got


def _kill_mid_loop(rank, world, spec, algo, path, victim):
    """All-reduce in a loop; the victim SIGKILLs itself from a timer, at a point of its loop
    that depends on timing (mid-collective or between two)."""
    import signal
    import threading

    import pyfast.comm as comm
    from pyfast.comm.engine import NativeEngine
    from pyfast.comm.failure import new_group_like
    os.environ.pop("PYFAST_COMM_REFERENCE", None)
    os.environ["PYFAST_COMM_CHUNK"] = "8192"  # pieces in flight when the peer dies
    if path == "reference":
        os.environ["PYFAST_COMM_REFERENCE"] = "1"
    shape = (100, 500) if spec.startswith("powersgd") else (50_000,)
    ts = [torch.randn(shape, generator=torch.Generator().manual_seed(rank + i)) for i in range(2)]
    # What a user does: a group (or the engine's private one) with timeout=.
    group = new_group_like(None, timeout=USER_TIMEOUT) if path != "engine" else None
    engine = NativeEngine.private(None, USER_TIMEOUT) if path == "engine" else None
    found, start, i = {}, time.perf_counter(), 0
    try:
        for i in range(100_000):
            if i == 3 and rank == victim:
                threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGKILL)).start()
            if engine is not None:
                for h in [engine.all_reduce(t, spec, name=f"b{k}", algorithm=algo, op="avg")
                          for k, t in enumerate(ts)]:
                    h.wait()
            elif path == "async":
                comm.all_reduce(ts[0], spec, group, name="b0", algorithm=algo, op="avg",
                                async_op=True).wait()
            else:
                comm.all_reduce(ts[0], spec, group, name="b0", algorithm=algo, op="avg")
        found["error"] = None
    except Exception as e:  # what the test checks
        found.update(error=type(e).__name__, msg=str(e), took=time.perf_counter() - start, step=i)
    if engine is not None:
        try:
            engine.all_reduce(ts[0], spec, name="b0", algorithm=algo).wait()
            found["after"] = "no error"
        except Exception as e:  # noqa: BLE001
            found["after"] = f"{type(e).__name__}: {e}"
        t0 = time.perf_counter()
        engine.close()
        found["close"] = time.perf_counter() - t0
    return found


def test_a_killed_rank_makes_every_other_rank_raise_within_seconds():
    """Most survivors see the dead peer's closed sockets within milliseconds; one whose
    collective pairs only with the other survivor (who raised and left it) waits for the
    group's timeout: gloo cannot abort a group, and a survivor's open sockets keep a peer
    waiting. Both are within `timeout=`, never the default group's."""
    victim = 1
    bad, t0 = [], time.monotonic()
    for first in range(0, len(FAMILIES), BATCH):
        runs = [(f, _ranks(_kill_mid_loop, *f, victim)) for f in FAMILIES[first:first + BATCH]]
        for (spec, algo, path), pool in runs:
            bad += _check_kill(spec, algo, path, _collect(pool, dead=(victim,)))
    assert not bad, "\n".join(bad)
    print(f"{len(FAMILIES)} kills in {time.monotonic() - t0:.1f} s")


def _check_kill(spec, algo, path, got) -> list[str]:
    bad = []
    for rank, f in got.items():
        where = f"{spec}/{algo}/{path}, rank {rank}"
        if isinstance(f, RankError):
            bad.append(f"{where}: the rank itself failed: {f}\n{f.tb}")
            continue
        op = f"({spec}, {algo or choose(C.get(spec), 50_000, 3)})"
        if path == "engine":
            op += " on the native engine"
        if f["error"] != "CommError" or not f["msg"].startswith("all_reduce of b") \
                or op not in f["msg"] or f"failed on rank {rank}" not in f["msg"]:
            bad.append(f"{where}: expected CommError naming {op!r}, got {f}")
        elif f["took"] > USER_TIMEOUT + 10:  # generous: a loaded 2-core machine
            bad.append(f"{where}: raised only after {f['took']:.1f} s")
        if path == "engine":
            if "CommError" not in f["after"] or "not run" not in f["after"]:
                bad.append(f"{where}: a job after the failure: {f['after']}")
            if f["close"] > 10:
                bad.append(f"{where}: close() took {f['close']:.1f} s")
    return bad


def _silent_peer(rank, world, flag_dir):
    """Rank 2 makes the groups, then never calls a collective on them: its peers see it only
    through the groups' 3 s timeout (the default group's is PG_TIMEOUT)."""
    import pathlib

    import pyfast.comm as comm
    from pyfast.comm.engine import NativeEngine
    from pyfast.comm.failure import new_group_like
    sync_g, async_g = new_group_like(None, timeout=3), new_group_like(None, timeout=3)
    engine = NativeEngine.private(None, timeout=datetime.timedelta(seconds=3))
    flags = pathlib.Path(flag_dir)
    if rank == 2:
        deadline = time.monotonic() + 60
        while len(list(flags.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return "silent"
    t0 = time.perf_counter()
    eh = engine.all_reduce(torch.ones(1000), "int8", name="bucket0")  # all three run at once
    ah = comm.all_reduce(torch.ones(1000), "fp16", group=async_g, name="bucket1", async_op=True)
    found = {}
    for key, call in [("sync", lambda: comm.all_reduce(torch.ones(1000), "int4", group=sync_g,
                                                       name="bucket2")),
                      ("async", ah.wait), ("engine", eh.wait)]:
        try:
            call()
            found[key] = ("no error", "", time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            found[key] = (type(e).__name__, str(e), time.perf_counter() - t0)
    t1 = time.perf_counter()
    engine.close()  # destroys its private group too
    found["close"] = time.perf_counter() - t1
    (flags / str(rank)).touch()
    return found


def test_a_silent_rank_raises_after_the_groups_timeout(tmp_path):
    got = _collect(_ranks(_silent_peer, str(tmp_path)), timeout=90)
    assert got[2] == "silent"
    for rank in (0, 1):
        f = got[rank]
        assert not isinstance(f, RankError), f"{f}\n{f.tb}"
        for key, op in [("sync", "all_reduce of bucket2 (int4, allgather)"),
                        ("async", "all_reduce of bucket1 (fp16, allgather)"),
                        ("engine", "all_reduce of bucket0 (int8, allgather) on the native engine")]:
            kind, msg, took = f[key]
            assert kind == "CommError" and msg.startswith(op), f"rank {rank} {key}: {kind}: {msg}"
            assert f"failed on rank {rank}" in msg, msg
            # 3 s, not the default group's 60: generous for a loaded machine
            assert 2.5 < took < 15, f"rank {rank} {key}: raised after {took:.1f} s"
        assert f["close"] < 10, f"rank {rank}: engine.close() took {f['close']:.1f} s"


@pytest.mark.parametrize("exc", [RuntimeError("Connection reset by peer"),
                                 torch.distributed.DistBackendError("gloo: timed out")])
def test_handles_name_the_operation(exc):
    """No process group needed: the engine's handle re-raises a backend error as CommError
    naming the operation."""
    from pyfast.comm.engine import _job_handle
    from pyfast.comm.failure import CommError

    class Failing:
        def wait(self, job):
            raise exc
    with pytest.raises(CommError, match=r"^all_reduce of g \(int8, allgather\) on the native "
                                         r"engine failed on rank 0: "):
        _job_handle(Failing(), 0, torch.ones(1), "all_reduce of g (int8, allgather) on the "
                    "native engine").wait()
