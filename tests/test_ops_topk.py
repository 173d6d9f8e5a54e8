"""Top-k threshold selection with fused error feedback: C++ and Triton against the reference.

For one threshold the selected set is exact (|r| >= t with r = x + ef, one fp32 add), so
counts, indices, values and the updated error-feedback memory are compared bitwise.
"""
import pytest
import torch

from conftest import backend_params
from pyfast.errors import NonFiniteGradient
from pyfast.ops import status, topk

# 100_003: many Triton programs and a ragged tail; 1_000_003: the C++ kernels' threads. The
# interpreter runs ~1 ms a program: its million-element fp32 cases took 54-66 s each under load
# (17 s quiet), so Triton takes its many-program case at 100_003 (196 blocks of 512)
SIZES = [1, 1023, 1025, 100_003, 1_000_003]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def grad(n, dtype, heavy=False):
    x = torch.randn(n)
    if heavy:  # a few coordinates dominate, as in embedding gradients
        x = x * torch.exp(2 * torch.randn(n))
    return x.to(dtype)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_ef", [False, True], ids=["plain", "ef"])
def test_count_and_select_match_reference(backend, n, dtype, with_ef):
    if backend == "triton" and (n > 200_000 or n > 100_000 and dtype != torch.float32):
        pytest.skip("interpreter: the many-program case is n = 100_003, float32")
    x = grad(n, dtype)
    ef = torch.randn(n) * 0.1 if with_ef else None
    t = float(x.float().abs().quantile(0.9)) if n > 1 else 0.5
    got = topk.topk_count(x, ef, t, backend=backend)
    assert torch.equal(got, topk.topk_count_ref(x, ef, t))
    limit = max(1, int(got[0]) - 3)  # the cap must cut the selection in index order
    ef2 = ef.clone() if with_ef else None
    v, i = topk.topk_select(x, ef, t, limit, backend=backend)
    rv, ri = topk.topk_select_ref(x, ef2, t, limit)
    assert i.dtype == torch.int32 and v.dtype == dtype
    assert torch.equal(i, ri) and torch.equal(v, rv)
    if with_ef:
        assert torch.equal(ef, ef2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpp_select_serial_and_parallel_match_reference(threads, dtype):
    """csrc/topk.cpp selects in one pass on one thread, in three steps on more: both equal the
    reference bitwise, with the cap cutting mid-tile and ef stored past it."""
    ok, why = status("cpp", torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    n = 1_000_003
    x, ef = grad(n, dtype), torch.randn(n) * 0.1
    t = float(x.float().abs().quantile(0.99))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for limit in (10 ** 9, 5_000, 0):  # no cap, a cap mid-tensor, nothing kept
            e1, e2 = ef.clone(), ef.clone()
            v, i = topk.topk_select(x, e1, t, limit, backend="cpp")
            rv, ri = topk.topk_select_ref(x, e2, t, limit)
            assert torch.equal(i, ri) and torch.equal(v, rv) and torch.equal(e1, e2), limit
            v, i = topk.topk_select(x, None, t, limit, backend="cpp")
            rv, ri = topk.topk_select_ref(x, None, t, limit)
            assert torch.equal(i, ri) and torch.equal(v, rv), limit
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("heavy", [False, True], ids=["gauss", "heavy"])
def test_topk_count_in_band_and_nothing_lost(backend, ratio, heavy):
    n = 200_003 if backend != "triton" else 20_011
    x = grad(n, torch.float32, heavy)
    ef = torch.randn(n) * 0.5
    total = x + ef
    v, i = topk.topk(x, ratio, ef, backend=backend)
    k, lo, hi = topk.target(n, ratio)
    assert lo <= v.numel() <= hi, f"kept {v.numel()}, want [{lo}, {hi}] around {k}"
    assert torch.equal(i, i.sort().values) and i.unique().numel() == i.numel()
    assert torch.equal(v, total[i.long()])  # kept values are exact
    rebuilt = ef.clone()
    rebuilt[i.long()] += v
    assert torch.equal(rebuilt, total)  # sent + memory == gradient + old memory
    # every kept magnitude is at least every dropped one, up to ties at the threshold
    dropped = ef.clone()
    dropped[i.long()] = 0
    assert v.abs().min() >= dropped.abs().max() or v.numel() == hi


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
def test_topk_backends_agree_end_to_end(backend):
    x = grad(50_021, torch.bfloat16, heavy=True)
    e1, e2 = torch.randn(50_021), None
    e2 = e1.clone()
    v, i = topk.topk(x, 0.01, e1, backend=backend)
    rv, ri = topk.topk(x, 0.01, e2, backend="torch")
    assert torch.equal(i, ri) and torch.equal(v, rv) and torch.equal(e1, e2)


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
def test_topk_ties_and_zeros(backend):
    for x in (torch.zeros(5000), torch.ones(5000), torch.tensor([3.0])):
        v, i = topk.topk(x, 0.01, backend=backend)
        k, lo, hi = topk.target(x.numel(), 0.01)
        assert lo <= v.numel() <= hi
        assert torch.equal(v, x[i.long()])


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_topk_rejects_nonfinite(backend, bad):
    x = torch.randn(4000)
    x[1234] = bad
    with pytest.raises(NonFiniteGradient, match="NaN/Inf"):  # its own type, a ValueError
        topk.topk(x, 0.01, torch.zeros(4000), backend=backend)


def test_topk_bad_arguments():
    x = torch.randn(100)
    for r in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="ratio"):
            topk.topk(x, r)
    with pytest.raises(TypeError, match="float32"):  # a wrong dtype is a TypeError
        topk.topk(x, 0.1, torch.zeros(100, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"float32\[100\]"):
        topk.topk(x, 0.1, torch.zeros(99))


def parts_of(n, step):
    return [(a, min(n, a + step)) for a in range(0, n, step)]


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["gauss", "ties"])
def test_selecting_part_by_part_is_topk(backend, dtype, case):
    """threshold() + topk_select per part, capped in index order (what compress_parts and the
    pipelined all-reduce do) == topk() on the whole tensor: same indices, values and ef, bitwise
    (same threshold, same per-element arithmetic). "ties": 3000 equal magnitudes, far more than
    the 1.5k cap, so the exact fallback's cap cuts inside a part."""
    n = 30_011 if backend == "triton" else 100_003  # ragged: no part size divides it
    x = grad(n, dtype, heavy=True) if case == "gauss" else torch.ones(n, dtype=dtype)
    ef = torch.randn(n) * 0.1 if case == "gauss" else torch.zeros(n)
    ef[::37] = 0.0
    bounds = parts_of(n, 4099)
    ef_whole, ef_parts = ef.clone(), ef.clone()
    v, i = topk.topk(x, 0.01, ef_whole, backend=backend)
    t, counts, limit = topk.threshold(x, 0.01, ef_parts, bounds, backend=backend)
    assert len(counts) == len(bounds) and sum(counts) >= v.numel()
    got_v, got_i, taken = [], [], 0
    for (a, b), c in zip(bounds, counts):
        pv, pi = topk.topk_select(x[a:b], ef_parts[a:b], t, min(c, limit - taken),
                                  backend=backend)
        taken += pv.numel()
        got_v.append(pv)
        got_i.append(pi + a)
    assert torch.equal(torch.cat(got_i), i) and torch.equal(torch.cat(got_v), v)
    assert torch.equal(ef_parts, ef_whole)
    if case == "ties":
        assert v.numel() == topk.target(n, 0.01)[2]  # the cap did cut


def test_threshold_bad_arguments():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="tile"):
        topk.threshold(x, 0.1, None, [(0, 50), (60, 100)])
    with pytest.raises(ValueError, match=r"float32\[100\]"):
        topk.threshold(x, 0.1, torch.zeros(99), [(0, 50), (50, 100)])
    with pytest.raises(ValueError, match="hold values"):
        topk.threshold(torch.empty(0), 0.1)
