"""pyfast.ops.attention: block_attention and its backward on every backend that runs here (cpp:
aten's flash kernel; triton in the interpreter is tests/test_attention_triton.py's) against the
reference, on fresh random inputs at ragged sizes, for each dtype; forced backends that cannot
run raise; bad shapes and dtypes are named.

Tolerances, relative to the reference's largest magnitude; the reference computes in fp32 from
the same (rounded) inputs: fp32 1e-5 (reordered sums of up to 70 terms, unit roundoff 6e-8);
bf16 2e-2 and fp16 4e-3: aten rounds the output, and in backward its internal P and dS, to the
input dtype (units 2^-8 = 3.9e-3 and 2^-11 = 4.9e-4), a few roundings each.
"""
from __future__ import annotations

import pytest
import torch

from pyfast.ops import attention as A
from pyfast.ops._backend import BackendUnavailable

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
SHAPES = [(1, 2, 37, 37, 24), (2, 3, 19, 45, 20), (1, 1, 70, 33, 64), (2, 2, 5, 5, 8)]


def _rel(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpp_matches_reference(shape, causal, dtype):
    b, h, sq, sk, d = shape
    q = torch.randn(b, h, sq, d, dtype=dtype)
    k, v = (torch.randn(b, h, sk, d, dtype=dtype) for _ in range(2))
    do = torch.randn(b, h, sq, d, dtype=dtype)
    out, lse = A.block_attention(q, k, v, causal, backend="cpp")
    ref, lse_ref = A.block_attention_ref(q, k, v, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert _rel(out, ref) <= TOL[dtype]
    # lse is fp32 for every dtype; from 16-bit inputs aten's scores carry the inputs' rounding
    # of the scaled q (measured 1.3e-5 relative), so 1e-4 there
    lse_tol = 1e-5 if dtype == torch.float32 else 1e-4
    assert float((lse - lse_ref).abs().max()) <= lse_tol * max(1.0, float(lse_ref.abs().max()))
    # the backward from the reference's out and lse (ring attention passes merged ones)
    got = A.block_attention_backward(do, q, k, v, ref, lse_ref, causal, backend="cpp")
    want = A.block_attention_backward_ref(do, q, k, v, ref, lse_ref, causal)
    for g, w, name in zip(got, want, "qkv"):
        assert g.dtype == dtype and g.shape == w.shape
        assert _rel(g, w) <= TOL[dtype], f"d{name}"


def test_reference_backward_is_autograd():
    """The hand-written reference backward equals autograd through the reference forward."""
    q, k, v = (torch.randn(2, 3, 21, 16, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    for causal in (False, True):
        out = torch.softmax((q @ k.transpose(-1, -2)) / 4 + torch.where(
            torch.ones(21, 21).tril().bool(), 0.0, float("-inf")) * causal, -1) @ v \
            if causal else torch.softmax((q @ k.transpose(-1, -2)) / 4, -1) @ v
        do = torch.randn_like(out)
        want = torch.autograd.grad(out, (q, k, v), do)
        o, lse = A.block_attention_ref(q.detach().float(), k.detach().float(), v.detach().float(),
                                       causal)
        got = A.block_attention_backward_ref(do.float(), q.detach().float(), k.detach().float(),
                                             v.detach().float(), o, lse, causal)
        for g, w in zip(got, want):
            assert _rel(g, w) <= 1e-5


def test_merged_blocks_equal_the_whole():
    """Two key blocks merged by log-sum-exp, and each block's backward from the merged out and
    lse, give the whole block's output and gradients (what ring attention relies on)."""
    q, do = torch.randn(1, 2, 29, 24), torch.randn(1, 2, 29, 24)
    k, v = torch.randn(1, 2, 41, 24), torch.randn(1, 2, 41, 24)
    (o1, l1), (o2, l2) = (A.block_attention(q, k[:, :, s], v[:, :, s])
                          for s in (slice(0, 17), slice(17, None)))
    lse = torch.logaddexp(l1, l2)
    out = torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2
    whole, lse_whole = A.block_attention_ref(q, k, v)
    assert _rel(out, whole) <= 1e-5 and _rel(lse, lse_whole) <= 1e-6
    g1, g2 = (A.block_attention_backward(do, q, k[:, :, s], v[:, :, s], out, lse)
              for s in (slice(0, 17), slice(17, None)))
    want = A.block_attention_backward_ref(do, q, k, v, whole, lse_whole)
    assert _rel(g1[0] + g2[0], want[0]) <= 1e-5
    assert _rel(torch.cat([g1[1], g2[1]], 2), want[1]) <= 1e-5
    assert _rel(torch.cat([g1[2], g2[2]], 2), want[2]) <= 1e-5


def test_bad_input_is_named():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match="float32.*bfloat16"):
        A.block_attention(q, q.bfloat16(), q)
    with pytest.raises(ValueError, match=r"\(1, 2, 8, 16\).*\(1, 2, 8, 8\)"):
        A.block_attention(q, torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))
    with pytest.raises(ValueError, match=r"\[B, H, S, D\]"):
        A.block_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="lse"):
        A.block_attention_backward(q, q, q, q, q, torch.zeros(1, 2, 9))


def test_forced_backends():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(BackendUnavailable, match="not cuda"):
        A.backend_for(torch.device("cuda"), "cpp")
    assert A.backend_for(torch.device("meta")) == "cpp"  # its meta kernel: the dry run's
    assert A.backend_for(torch.device("cpu"), "torch") == "torch"
    assert A.backend_for(torch.device("cpu")) == "cpp"
    out, _ = A.block_attention(q, q, q, backend="torch")
    assert _rel(out, A.block_attention(q, q, q, backend="cpp")[0]) <= 1e-5
