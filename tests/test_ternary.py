"""ternary (TernGrad): the C++ kernel equals the torch reference bit for bit; the compressor
runs through pyfast.comm.all_reduce and DataParallel on 2 ranks with bit-identical results,
although no file of pyfast/comm/ names it (it declares what comm needs: base.Compressor)."""
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import pyfast.compress as C
from pyfast.ops import ternary
from pyfast.ops._backend import cpp_status
from dist_utils import run_ranks

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
needs_cpp = pytest.mark.skipif(not cpp_status()[0], reason="pyfast._C is not built")


@needs_cpp
@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 3000), block=st.sampled_from([4, 8, 36, 512]),
       seed=st.integers(0, 2 ** 63 - 1), dt=st.sampled_from(FLOATS), out=st.sampled_from(FLOATS))
def test_kernel_equals_reference(n, block, seed, dt, out):
    x = (torch.randn(n) * 3).to(dt)
    if n > 8:
        x[1], x[2] = 0.0, -0.0
    codes, scales = ternary.encode(x, block, seed, backend="cpp")
    rc, rs = ternary.encode_ref(x, block, seed)
    assert torch.equal(codes, rc) and torch.equal(scales, rs)
    assert codes.numel() == -(-n // 4) and scales.numel() == -(-n // block)
    assert torch.equal(ternary.decode(codes, scales, n, block, out, backend="cpp"),
                       ternary.decode_ref(codes, scales, n, block, out))


@needs_cpp
def test_kernel_large_parallel_and_nonfinite():
    x = torch.randn(300_001)  # above the serial threshold: the OpenMP loop
    x[5], x[200_000] = float("nan"), float("inf")
    codes, scales = ternary.encode(x, 512, 7, backend="cpp")
    rc, rs = ternary.encode_ref(x, 512, 7)
    assert torch.equal(codes, rc) and torch.equal(scales.isnan(), rs.isnan())
    assert torch.equal(scales.nan_to_num(), rs.nan_to_num())
    y = ternary.decode(codes, scales, x.numel(), 512, torch.float32, backend="cpp")
    bad = torch.zeros(x.numel(), dtype=torch.bool)
    bad[:512] = True
    bad[200_000 // 512 * 512: 200_000 // 512 * 512 + 512] = True
    assert torch.equal(y.isnan(), bad)  # a non-finite block decodes to NaN, the rest stays finite


def test_compressor_bound_unbiased_and_wire():
    c = C.get("ternary")
    assert c.spec == "ternary" and c.algorithm == "dense" and c.lossy and not c.deterministic
    assert c.native_kind is None and c.block == ternary.DEFAULT_BLOCK
    x = torch.randn(5000)
    p = c.compress(x, "w")
    assert p.nbytes == c.wire_bytes(5000) == 4 * math.ceil(5000 / 512) + math.ceil(5000 / 4)
    y = c.decompress(c.from_wire(c.to_wire(p), x.shape, x.dtype))
    assert torch.equal(y, c.decompress(p))
    s = x.abs().view(-1)[:4608].view(9, 512).amax(1).repeat_interleave(512)
    assert ((y[:4608] - x[:4608]).abs() <= s).all()
    assert set(y[:512].unique().tolist()) <= {0.0, s[0].item(), -s[0].item()}
    mean = torch.stack([c.decompress(c.compress(x, "w")) for _ in range(300)]).mean(0)
    # E[y] = x: per element the draw's std is <= s/2, over 300 draws <= s / 34
    assert ((mean - x).abs() <= s.max() / 34 * 5).all()
    c2 = C.get("ternary")
    c2.load_state_dict(c.state_dict())  # the step counters: the same next draw
    assert torch.equal(c.compress(x, "w").tensors["codes"], c2.compress(x, "w").tensors["codes"])


def _ranks(rank, world):
    import pyfast.comm as comm
    from pyfast.parallel.data import DataParallel
    torch.manual_seed(100 + rank)
    out = {}
    xs = [torch.randn(n) for n in (5000, 70_000)]
    for algo in (None, "two-phase"):
        for x in xs:
            t = x.clone()
            comm.all_reduce(t, "ternary", name=f"g{x.numel()}", algorithm=algo)
            out[(algo, x.numel())] = (x, t)
    h = comm.all_reduce(xs[0].clone(), C.wrap(C.get("ternary")), async_op=True, name="ef")
    out["ef"] = h.wait()
    torch.manual_seed(0)
    net = DataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 4)),
                       "ternary", engine="python", bucket_mb=0.002)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(16, 32, generator=g)
        net(x).pow(2).mean().backward()
        opt.step()
    out["params"] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    out["buckets"] = len(net.bucketer.buckets)
    net.close()
    dist.barrier()
    return out


def test_all_reduce_and_data_parallel_two_ranks():
    res = run_ranks(_ranks, 2)
    for key in res[0]:
        if key == "buckets":
            continue
        a, b = res[0][key], res[1][key]
        a, b = (a[1], b[1]) if isinstance(a, tuple) else (a, b)
        assert torch.equal(a, b), f"{key}: ranks differ"
    assert res[0]["buckets"] > 1
    for algo in (None, "two-phase"):
        for n in (5000, 70_000):
            xs = [r[(algo, n)][0] for r in res]
            got, exact = res[0][(algo, n)][1], xs[0] + xs[1]
            scale = sum(x.abs().max() for x in xs)
            # each element: off by at most its blocks' scales (two roundings for two-phase)
            assert ((got - exact).abs() <= scale * (2 if algo else 1) + 1e-6).all(), (algo, n)
            if algo is None:  # allgather at W=2: the rank-order sum of the decoded payloads
                ref = torch.zeros(n)
                for r, x in enumerate(xs):
                    c = C.get("ternary")
                    ref += c.decompress(c.compress(x, f"g{n}")).to(torch.float32)
                assert torch.equal(got, ref)


def test_a_backend_asked_for_without_a_ternary_kernel_raises():
    from pyfast.ops._backend import BackendUnavailable
    x = torch.randn(1000)
    with pytest.raises(BackendUnavailable, match="no Triton kernel"):
        ternary.encode(x, backend="triton")
