"""The native overlap engine (pyfast._C.Engine through pyfast.comm.engine) at 2 and 4 gloo ranks.

Oracle: pyfast.comm.all_reduce on the same inputs, both its pipelined path (chunks of 4096
elements, so a 70K tensor is many pieces in flight) and its reference functions
(PYFAST_COMM_REFERENCE=1). The engine must match it bitwise (the output and every
error-feedback memory, by name), over two steps so that the memories feed back, with all of a
step's jobs queued before the first wait and waited in reverse order (FIFO on the worker keeps
the collectives in step across ranks). A failing collective must surface from wait(), not hang.
"""
import pytest
import torch

from spawn import run_ranks

KINDS = ["none", "fp16", "bf16", "int8", "int4", "fp8", "sign"]
CASES = [(k, a, fb) for k in KINDS for a in ([None] if k == "none" else ["two-phase", "allgather"])
         for fb in (False, True)]
SIZES = [70_007, 100]  # ragged; 100 leaves two-phase parts empty at W=4 (and W=2: block 512)


def inputs(rank, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)) * (rank + 1)


def bits(t):
    return t.view(torch.int32)


def _worker(rank, world, mode):
    import os

    import pyfast.comm as comm
    import pyfast.compress as C
    from pyfast.comm.engine import NativeEngine
    os.environ["PYFAST_COMM_REFERENCE" if mode == "reference" else "PYFAST_COMM_CHUNK"] = \
        "1" if mode == "reference" else "4096"
    engine = NativeEngine()
    make = lambda k, fb: C.WithFeedback(C.get(k)) if fb else C.get(k)  # noqa: E731
    cases = [(n, *c) for n in SIZES for c in CASES]
    mine = {c: (inputs(rank, c[0]), make(c[1], c[3])) for c in cases}
    ref = {c: (inputs(rank, c[0]), make(c[1], c[3])) for c in cases}
    bad = []
    for step in range(2):
        handles = [(c, engine.all_reduce(mine[c][0], mine[c][1], "avg" if i % 2 else "sum",
                                         "g", c[2]))
                   for i, c in enumerate(cases)]
        for c, h in reversed(handles):
            h.wait()
            assert h.seconds > 0, f"{c}: seconds {h.seconds}"
        for i, c in enumerate(cases):
            comm.all_reduce(ref[c][0], ref[c][1], op="avg" if i % 2 else "sum", name="g",
                            algorithm=c[2])
            if not torch.equal(bits(mine[c][0]), bits(ref[c][0])):
                bad.append(f"step {step} {c}: output differs from pyfast.comm.all_reduce")
            if c[3]:
                a, b = mine[c][1].feedback.memory, ref[c][1].feedback.memory
                if a.keys() != b.keys() or any(not torch.equal(bits(a[k]), bits(b[k])) for k in a):
                    bad.append(f"step {step} {c}: error feedback {sorted(a)} vs {sorted(b)}")
    return bad, {c: mine[c][0] for c in cases}


@pytest.mark.parametrize("mode", ["pipelined", "reference"])
@pytest.mark.parametrize("world", [2, 4])
def test_engine_matches_all_reduce_bitwise(world, mode):
    out = run_ranks(_worker, world, mode)
    for rank, (bad, _) in enumerate(out):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)
    for c, t in out[0][1].items():
        for r in range(1, world):
            assert torch.equal(bits(out[r][1][c]), bits(t)), f"{c}: rank {r} differs from rank 0"


def _errors(rank, world):
    import datetime
    import time

    import torch.distributed as dist

    import pyfast.compress as C
    from pyfast import _C
    from pyfast.comm.engine import NativeEngine
    found = {}
    # Bad arguments fail on the caller's thread, naming the problem.
    engine = NativeEngine()
    assert NativeEngine.supports("int8") and NativeEngine.supports(C.WithFeedback(C.get("sign")))
    assert not NativeEngine.supports("topk:0.1") and not NativeEngine.supports("powersgd:2")
    assert not NativeEngine.supports(C.get("int8", stochastic=True))
    for call, words in [
            (lambda: engine.all_reduce(torch.ones(8), "topk:0.1"), "does not run"),
            (lambda: engine.all_reduce(torch.ones(8, dtype=torch.bfloat16), "int8"), "float32"),
            (lambda: engine._engine.submit(torch.ones(8), "int9", 512, "allgather", False, [],
                                           512, 0), "unknown compression kind"),
            (lambda: engine._engine.submit(torch.ones(8), "int8", 512, "allgather", False,
                                           [torch.zeros(7)], 512, 0), "holds 7 elements")]:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=words):
            call()
    # Dropping the engine with jobs queued runs them (every rank issued them) and joins.
    ts = [torch.full((1000,), float(rank + 1)) for _ in range(3)]
    hs = [engine.all_reduce(t, "none") for t in ts]
    del engine, hs
    found["drained"] = all(torch.equal(t, torch.full((1000,), world * (world + 1) / 2)) for t in ts)
    # A collective that times out on the worker raises from wait(); later jobs are refused
    # (the ranks may be out of step) instead of being paired with another rank's next bucket.
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    if rank == 0:  # rank 1 never joins
        engine = NativeEngine(group)
        t0 = time.perf_counter()
        first, second = engine.all_reduce(torch.ones(10), "int8"), engine.all_reduce(torch.ones(10), "int8")
        for key, h in (("first", first), ("second", second)):
            with pytest.raises(RuntimeError) as e:
                h.wait()
            found[key] = str(e.value)
        found["seconds"] = time.perf_counter() - t0
        with pytest.raises(RuntimeError):  # a handle re-raises, it does not wait again
            first.wait()
        del engine
    dist.barrier()
    return found


def test_engine_errors_surface_and_never_hang():
    found = run_ranks(_errors, 2)
    assert found[0]["drained"] and found[1]["drained"]
    assert "job 0" in found[0]["first"] and "Timed out" in found[0]["first"], found[0]["first"]
    assert "not run" in found[0]["second"] and "job 0" in found[0]["second"], found[0]["second"]
    assert found[0]["seconds"] < 20, f"timeout took {found[0]['seconds']:.1f} s"
