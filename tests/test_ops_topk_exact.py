"""Exact top-k by magnitude (pyfast.ops.topk.topk_exact): the Triton radix select (run here in
Triton's interpreter) against the reference, bitwise: the same indices in the same (ascending)
order and the same values, ties at the k-th magnitude to the lower index. Sizes: one program,
a ragged tail, many programs; inputs gradient-like, heavy-tailed, and with ties and zeros."""
import pytest
import torch

from pyfast.ops import status, topk
from pyfast.ops._backend import BackendUnavailable

TRITON = status("triton", torch.device("cpu"))[0]
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton's interpreter is not available")


def values(n, dtype, kind):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    if kind == "heavy":  # a few coordinates dominate, as in embedding gradients
        x = x * torch.exp(2 * torch.randn(n, generator=g))
    elif kind == "ties":  # few distinct magnitudes: the k-th is shared by many, zeros too
        x = torch.randint(-3, 4, (n,), generator=g).float() * 0.5
    return x.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, ratio", [(1, 1.0), (1023, 0.01), (2049, 0.3), (20_011, 0.01),
                                      (70_001, 0.01)])  # 70_001: 3 histogram programs
@pytest.mark.parametrize("kind", ["gauss", "heavy", "ties"])
def test_radix_select_matches_reference(n, ratio, dtype, kind):
    x = values(n, dtype, kind)
    k = max(1, round(ratio * n))
    v, i = topk.topk_exact(x, k, backend="triton")
    rv, ri = topk.topk_exact_ref(x, k)
    assert i.dtype == torch.int32 and v.dtype == dtype and len(i) == k
    assert torch.equal(i, ri) and torch.equal(v, rv)


@needs_triton
def test_radix_select_edges():
    x = values(5000, torch.float32, "gauss")
    for k in (0, 1, 4999, 5000):  # nothing, the largest, all but one, everything
        assert torch.equal(topk.topk_exact(x, k, backend="triton")[1],
                           topk.topk_exact_ref(x, k)[1])
    x[17], x[4000] = float("inf"), float("nan")  # NaN above inf, as torch.topk
    assert topk.topk_exact(x, 2, backend="triton")[1].tolist() == [17, 4000]


def test_reference_is_the_k_largest_with_ties_to_the_lower_index():
    x = torch.tensor([0.5, -2.0, 1.0, -1.0, 2.0, 0.0, 1.0])
    v, i = topk.topk_exact_ref(x, 4)
    assert i.tolist() == [1, 2, 3, 4] and v.tolist() == [-2.0, 1.0, -1.0, 2.0]
    big = values(10_000, torch.float32, "gauss")
    ref = torch.topk(big.abs(), 100).indices.sort().values  # no ties in Gaussian draws
    assert torch.equal(topk.topk_exact_ref(big, 100)[1], ref.to(torch.int32))


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        topk.topk_exact(torch.arange(5), 2)
    with pytest.raises(ValueError, match=r"k must be in \[0, 5\]"):
        topk.topk_exact(torch.randn(5), 6)
    with pytest.raises(BackendUnavailable, match="cannot run topk_exact"):
        topk.topk_exact(torch.randn(5), 2, backend="cpp")
