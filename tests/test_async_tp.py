"""Overlapped sequence-parallel matmuls (pyfast.parallel.async_tp) at 2 and 4 gloo ranks against
the non-overlapped path built from tp_comm: gather_from_sequence_parallel_region + F.linear, and
F.linear + reduce_scatter_to_sequence_parallel_region (+ bias).

Each rank computes both paths on the same fresh random inputs and reports, per case and tensor
(output, grad x, grad weight, grad bias), the max abs difference and the reference's max abs
value. Expected:
  - bit for bit wherever no sum changes order: the gathers and GEMMs always (row blocks of at
    least MIN_ROWS rows run MKL's kernel of the whole GEMM), and the reduce-scatter at 2 ranks
    (a + b commutes);
  - at 4 ranks the reduce-scatter (linear_reduce_scatter's output, all_gather_linear's grad x)
    adds the 4 partial sums in rank order, gloo in its ring's order; each order rounds W - 1
    times, so they may differ by 2 (W - 1) = 6 ulps of the largest magnitude (fp32 2^-23,
    bf16 2^-8 times max|ref|). Measured: fp32 7.6e-6 = 1.3 ulps, bf16 0.5 = 2.8 ulps.
The native engine (fp32 only) runs the same cases when it has all-gather jobs.
"""
import pytest
import torch

from dist_utils import RankPool

# (rows per rank, in features, out features, extra dims between sequence and features, dim)
SHAPES = [(5, 33, 65, (), 0), (37, 65, 33, (), 0), (3, 33, 65, (), 0), (6, 33, 65, (3,), 0),
          (5, 33, 65, (2,), 1)]
CHUNKS = [1, 2, 3, 7]  # 7 divides none of the row counts
DTYPES = [torch.float32, torch.bfloat16]
EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8}
NAMES = ("out", "grad_x", "grad_w", "grad_b")
SUMMED = {("agl", "grad_x"), ("lrs", "out")}  # results that went through a reduce-scatter


def _x_shape(rows, k, mid, dim, world, full):
    seq = rows * world if full else rows
    shape = [seq, *mid, k] if dim == 0 else [mid[0], seq, k]
    return shape


def _run(fn, x, w, b, gy):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    b = None if b is None else b.clone().requires_grad_(True)
    y = fn(x, w, b)
    y.backward(gy)
    return [y.detach(), x.grad, w.grad, None if b is None else b.grad]


def _compare(ours, ref):
    out = {}
    for name, a, r in zip(NAMES, ours, ref):
        if r is not None:
            out[name] = ((a.float() - r.float()).abs().max().item(), r.float().abs().max().item(),
                         a.dtype == r.dtype and a.shape == r.shape)
    return out


def _cases(rank, world, comms):
    import torch.nn.functional as F

    from pyfast.parallel import async_tp
    from pyfast.parallel import tp_comm
    g = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    res = {}
    for (rows, k, n, mid, dim), dtype, bias in [(s, d, b) for s in SHAPES for d in DTYPES
                                                for b in (True, False)]:
        for kind in ("agl", "lrs"):
            full = kind == "lrs"
            xs = _x_shape(rows, k, mid, dim, world, full)
            x = torch.randn(xs, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            ys = list(xs)
            ys[-1], ys[dim] = n, rows * world if kind == "agl" else rows
            gy = torch.randn(ys, generator=g).to(dtype)
            if kind == "agl":
                ref = _run(lambda x, w, b: F.linear(
                    tp_comm.gather_from_sequence_parallel_region(x, dim=dim), w, b), x, w, b, gy)
            else:
                ref = _run(lambda x, w, b: tp_comm.reduce_scatter_to_sequence_parallel_region(
                    F.linear(x, w), dim=dim) + (0 if b is None else b), x, w, b, gy)
            fn = async_tp.all_gather_linear if kind == "agl" else async_tp.linear_reduce_scatter
            for name, comm in comms.items():
                if name == "engine" and dtype != torch.float32:
                    continue
                for c in CHUNKS:
                    ours = _run(lambda x, w, b: fn(x, w, b, dim=dim, pieces=c, comm=comm),
                                x, w, b, gy)
                    res[(kind, rows, k, n, mid, dim, str(dtype), bias, name, c)] = \
                        _compare(ours, ref)
    return res


def _worker(rank, world, with_engine):
    comms = {"c10d": "c10d"}
    engine = None
    if with_engine:
        from pyfast.comm.engine import NativeEngine
        engine = comms["engine"] = NativeEngine.private()
    try:
        return _cases(rank, world, comms)
    finally:
        if engine is not None:
            engine.close()


def _subgroups(rank, world):
    """Two tensor-parallel groups of 2 ([0, 1], [2, 3]): group ranks, not global ones."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from pyfast.parallel import async_tp
    from pyfast.parallel import tp_comm
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = groups[rank // 2]
    g = torch.Generator().manual_seed(rank)
    x, xf, w, b = (torch.randn(9, 33, generator=g), torch.randn(18, 33, generator=g),
                   torch.randn(65, 33, generator=g), torch.randn(65, generator=g))
    gy, gz = torch.randn(18, 65, generator=g), torch.randn(9, 65, generator=g)
    agl = _run(lambda x, w, b: async_tp.all_gather_linear(x, w, b, tp, pieces=2), x, w, b, gy)
    lrs = _run(lambda x, w, b: async_tp.linear_reduce_scatter(x, w, b, tp, pieces=2), xf, w, b, gz)
    import warnings
    with warnings.catch_warnings(record=True) as seen:  # the deprecated name still works
        warnings.simplefilter("always")
        old = _run(lambda x, w, b: async_tp.all_gather_linear(x, w, b, tp, chunks=2), x, w, b, gy)
    agl = agl + [o if any(issubclass(m.category, DeprecationWarning) for m in seen) else None
                 for o in old]
    ref = _run(lambda x, w, b: F.linear(tp_comm.gather_from_sequence_parallel_region(x, tp), w, b),
               x, w, b, gy)
    ref = ref + ref  # for pieces= and the deprecated chunks=
    lref = _run(lambda x, w, b: tp_comm.reduce_scatter_to_sequence_parallel_region(
        F.linear(x, w), tp) + b, xf, w, b, gz)
    wrong = "no engine"
    if _engine_ok():  # an engine on all 4 ranks cannot serve a group of 2
        from pyfast.comm.engine import NativeEngine
        engine = NativeEngine.private()
        try:
            async_tp.all_gather_linear(x, w, group=tp, comm=engine)
        except ValueError as e:
            wrong = str(e)
        engine.close()
    return [a is not None and torch.equal(a, r) for a, r in zip(agl + lrs, ref + lref)], wrong


def _errors(rank, world):
    from pyfast.parallel import async_tp
    w = torch.randn(8, 6)
    bad = {
        "rows": lambda: async_tp.linear_reduce_scatter(torch.randn(world * 3 + 1, 6), w),
        "pieces0": lambda: async_tp.all_gather_linear(torch.randn(5, 6), w, pieces=0),
        "chunks0": lambda: async_tp.all_gather_linear(torch.randn(5, 6), w, chunks=0),
        "features": lambda: async_tp.all_gather_linear(torch.randn(5, 7), w),
        "bias": lambda: async_tp.all_gather_linear(torch.randn(5, 6), w, torch.randn(7)),
        "wdtype": lambda: async_tp.all_gather_linear(torch.randn(5, 6), w.bfloat16()),
        "bdtype": lambda: async_tp.linear_reduce_scatter(torch.randn(4, 6), w, torch.randn(8).double()),
        "dim": lambda: async_tp.all_gather_linear(torch.randn(5, 6), w, dim=-1),
        "vector": lambda: async_tp.all_gather_linear(torch.randn(6), w),
        "comm": lambda: async_tp.all_gather_linear(torch.randn(5, 6), w, comm="nccl"),
        "engine": lambda: async_tp.all_gather_linear(torch.randn(5, 6), w, comm="engine"),
        "ranks": lambda: async_tp.all_gather_linear(torch.randn(4 + rank, 6), w),
        "dtypes": lambda: async_tp.linear_reduce_scatter(torch.randn(4, 6).to(DTYPES[rank % 2]),
                                                  w.to(DTYPES[rank % 2])),
    }
    out = {}
    for name, fn in bad.items():
        try:
            fn()
            out[name] = "no error"
        except (ValueError, TypeError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _engine_ok() -> bool:
    from pyfast.comm import engine
    return hasattr(engine.NativeEngine, "all_gather_into") and engine.status()[0]


@pytest.fixture(scope="module", params=[2, 4])
def pool(request):
    with RankPool(request.param, pg_timeout=60) as p:
        yield p


def test_matches_non_overlapped_path(pool):
    world = pool.world_size
    results = pool.run(_worker, _engine_ok(), timeout=300)
    checked = 0
    for rank, res in enumerate(results):
        for key, per in res.items():
            kind, dtype, comm = key[0], key[6], key[8]
            for name, (diff, scale, same_layout) in per.items():
                where = f"rank {rank} {key} {name}"
                assert same_layout, f"{where}: dtype or shape differs from the reference"
                if (kind, name) in SUMMED and world > 2:
                    tol = 2 * (world - 1) * EPS[getattr(torch, dtype.split(".")[1])] * scale
                    assert diff <= tol, f"{where}: {diff:.3g} > {tol:.3g}"
                else:
                    assert diff == 0, f"{where}: differs by {diff:.3g}, expected bit for bit"
                checked += 1
    assert checked > 1000


def test_tensor_parallel_subgroups(pool):
    if pool.world_size != 4:
        pytest.skip("two groups of 2 need 4 ranks")
    for rank, (same, wrong) in enumerate(pool.run(_subgroups)):
        assert all(same), f"rank {rank}: bit for bit per tensor {same}"
        assert wrong == "no engine" or "engine's ranks are not the group's" in wrong, wrong


def test_bad_inputs_fail_fast(pool):
    world = pool.world_size
    for msg in pool.run(_errors):
        assert f"x, dim (({3 * world + 1}, 6), 0) not divisible by the tensor-parallel size" \
            in msg["rows"]
        assert "pieces must be an int >= 1" in msg["pieces0"]
        assert "chunks must be an int >= 1" in msg["chunks0"]  # the deprecated name, named
        assert "weight (8, 6) torch.float32 is not [out, 7] torch.float32" in msg["features"]
        assert "weight (8, 6) torch.bfloat16 is not [out, 6] torch.float32" in msg["wdtype"]
        assert msg["wdtype"].startswith("TypeError") and msg["bdtype"].startswith("TypeError")
        assert all(msg[k].startswith("ValueError") for k in ("rows", "features", "bias", "ranks"))
        assert "bias (7,) torch.float32 is not [8] torch.float32" in msg["bias"]
        assert "bias (8,) torch.float64 is not [8] torch.float32" in msg["bdtype"]
        assert "x, dim ((5, 6), -1) needs a sequence dim" in msg["dim"]
        assert "x, dim ((6,), 0) needs a sequence dim" in msg["vector"]
        assert "comm must be 'c10d'" in msg["comm"]
        assert "engine" in msg["engine"] and msg["engine"] != "no error"
        assert "ranks disagree" in msg["ranks"] and "[[4, 6, " in msg["ranks"]
        assert "ranks disagree" in msg["dtypes"]
