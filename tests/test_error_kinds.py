"""One error type per kind of mistake (DESIGN.md): a wrong dtype is a TypeError at every public
entry point that checks dtypes, a wrong value, shape, size or count a ValueError; and comm.agree
raises one rank's mistake with its own type on every rank."""
import pytest
import torch

from dist_utils import run_ranks

SPECS = ("none", "fp16", "bf16", "int8", "int4", "fp8", "sign", "topk:0.5", "randomk:0.5",
         "powersgd:1", "ternary")


def _kind(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the type is what is checked)
        return type(e).__name__
    return "no error"


def test_ops_and_compressors():
    import pyfast.compress as C
    from pyfast.ops import quantize, topk
    ints, x = torch.zeros(8, 4, dtype=torch.int32), torch.randn(64)
    assert _kind(lambda: topk.topk(ints, 0.5)) == "TypeError"
    assert _kind(lambda: topk.topk(x, 0.5, torch.zeros(64, dtype=torch.float16))) == "TypeError"
    assert _kind(lambda: topk.topk(x, 0.5, torch.zeros(63))) == "ValueError"
    assert _kind(lambda: topk.topk(x, 1.5)) == "ValueError"
    assert _kind(lambda: quantize.quantize(ints, "int8")) == "TypeError"
    for spec in SPECS:
        assert _kind(lambda: C.get(spec).compress(ints, "g")) == "TypeError", spec


def _entry_points(rank, world):
    """Each public entry point of comm / parallel with a wrong dtype and a wrong size, on a
    gloo group of one rank."""
    from torch import nn

    import pyfast.comm as comm
    from pyfast.comm.engine import NativeEngine, status
    from pyfast.parallel import async_tp
    from pyfast.parallel.data import DataParallel

    f32, i64 = torch.zeros(8), torch.zeros(8, dtype=torch.int64)
    w = torch.randn(8, 6)
    cases = {
        "all_reduce/dtype": lambda: comm.all_reduce(i64, "int8"),
        "all_reduce/op": lambda: comm.all_reduce(f32, "int8", op="max"),
        "reduce_scatter/dtype": lambda: comm.reduce_scatter(i64.clone(), i64, "int8"),
        "reduce_scatter/out-dtype": lambda: comm.reduce_scatter(torch.zeros(8).half(), f32),
        "reduce_scatter/out-size": lambda: comm.reduce_scatter(torch.zeros(7), f32, "int8"),
        "all_gather/dtype": lambda: comm.all_gather(i64.clone(), i64, "int8"),
        "all_gather/out-dtype": lambda: comm.all_gather(torch.zeros(8).half(), f32, "int8"),
        "all_gather/out-size": lambda: comm.all_gather(torch.zeros(9), f32, "int8"),
        "DataParallel/dtype": lambda: DataParallel(nn.Linear(3, 3).double(), None),
        "DataParallel/bucket": lambda: DataParallel(nn.Linear(3, 3), None, bucket_mb=0),
        "all_gather_linear/weight-dtype": lambda: async_tp.all_gather_linear(
            torch.randn(5, 6), w.bfloat16()),
        "all_gather_linear/weight-size": lambda: async_tp.all_gather_linear(
            torch.randn(5, 7), w),
        "linear_reduce_scatter/bias-dtype": lambda: async_tp.linear_reduce_scatter(
            torch.randn(4, 6), w, torch.randn(8).double()),
        "linear_reduce_scatter/bias-size": lambda: async_tp.linear_reduce_scatter(
            torch.randn(4, 6), w, torch.randn(7)),
    }
    out = {k: _kind(fn) for k, fn in cases.items()}
    if status()[0]:
        engine = NativeEngine()
        out["engine/dtype"] = _kind(lambda: engine.all_reduce(torch.zeros(8).bfloat16(), "int8"))
        out["engine/contiguous"] = _kind(lambda: engine.all_reduce(torch.zeros(4, 4).t(), "int8"))
        engine.close()
    return out


def test_public_entry_points():
    out = run_ranks(_entry_points, 1)[0]
    for key, got in out.items():
        want = "TypeError" if key.split("/")[1] in ("dtype", "out-dtype", "weight-dtype",
                                                    "bias-dtype") else "ValueError"
        assert got == want, f"{key}: {got}, expected {want}"
    from pyfast.comm.engine import status
    assert len(out) == 16 if status()[0] else len(out) == 14


def _agree(rank, world):
    import torch.distributed as dist

    from pyfast.comm.agree import agree
    real, objects = dist.all_gather_object, []

    def counting(*args, **kwargs):
        objects.append(1)
        return real(*args, **kwargs)
    dist.all_gather_object = counting
    try:
        agree(("same", 3), None)
        out = {"objects when they agree": len(objects)}
        for key, fn in {
                "differ": lambda: agree(("shape", rank), None, what="op"),
                "type on rank 1": lambda: agree("x", TypeError("wrong dtype") if rank else None,
                                                what="op"),
                "value everywhere": lambda: agree("x", ValueError(f"bad size {rank}")),
        }.items():
            try:
                fn()
                out[key] = None
            except Exception as e:  # noqa: BLE001
                out[key] = (type(e).__name__, str(e))
    finally:
        dist.all_gather_object = real
    return out


def test_agree_raises_the_same_error_everywhere():
    out = run_ranks(_agree, 2)
    assert out[0] == out[1]
    got = out[0]
    assert got["objects when they agree"] == 0  # the cheap path: one all-gather of a digest
    assert got["differ"] == ("ValueError", "op: ranks differ: rank 0 has ('shape', 0), "
                                           "rank 1 has ('shape', 1)")
    assert got["type on rank 1"] == ("TypeError", "op: wrong dtype (rank(s) [1])")
    assert got["value everywhere"] == ("ValueError", "bad size 0 (rank(s) [0, 1])")


@pytest.mark.parametrize("problem", [TypeError("t is int64"), ValueError("3 elements")])
def test_agree_alone_raises_its_own_problem(problem):
    from pyfast.comm.agree import agree
    agree("anything", None)  # no process group: nothing to agree with
    with pytest.raises(type(problem), match=str(problem)):
        agree("anything", problem)
