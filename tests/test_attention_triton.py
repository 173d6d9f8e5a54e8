"""kernels/attention.py (Triton flash attention with lse, for ring attention) in Triton's
interpreter against a float64 reference written out here (explicit scores, mask, logsumexp,
softmax and the backward formulas), against aten's CPU flash-attention ops, and for the property
ring attention relies on: per-block backward with the GLOBAL (merged) out and lse sums to the
full-attention gradients.

Shapes are small and ragged (Sq, Sk not multiples of the 16-row blocks; D = 20, 24, 40 not
powers of two) so that each launch spans several blocks on every axis and stays cheap in the
interpreter.

Tolerances: max |got - ref| <= TOL * max |ref| per tensor (ref in float64 from the same,
already rounded, inputs).
(Observed maxima below: every CASES x dtype, 3 seeds.)
  fp32 1e-5: fp32 unit roundoff 6e-8; sums of <= 64 terms and exp2 of rescaled scores give
       <= 5.7e-7 observed, so 1e-5 leaves > 10x margin while catching any indexing/mask error.
  bf16 2e-2: the result is rounded to bf16 (unit roundoff 2^-8 = 3.9e-3 relative) and P / ds
       are rounded to bf16 before their products (as on tensor cores): a few roundings, up to
       6.0e-3 observed; 2e-2 is ~5 roundings.
  fp16 2e-3: same with unit roundoff 2^-11 = 4.9e-4; up to 6.5e-4 observed.
  lse is fp32 for every dtype (computed from the exactly widened inputs): |err| <= 1e-5 *
       max(1, max |lse|) (1.1e-7 observed).
"""
import os

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"triton not importable: {e}", allow_module_level=True)

from pyfast.kernels import attention  # noqa: E402
from pyfast.kernels.attention import block_attention_bwd, block_attention_fwd  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
LSE_TOL = 1e-5
DTYPES = list(TOL)
# (B, H, Sq, Sk, D, causal); causal with Sq != Sk is top-left aligned (key j visible to i <= j)
CASES = [(1, 2, 37, 37, 24, False), (1, 2, 37, 37, 24, True),
         (2, 1, 33, 50, 40, False), (2, 1, 33, 50, 40, True),
         (1, 1, 16, 16, 64, False), (1, 1, 16, 16, 64, True),
         (1, 3, 19, 45, 20, False), (1, 1, 45, 19, 20, True)]


# --------------------------------------------------------------------------- reference
def _scores(q, k, causal, scale):
    s = scale * q.double() @ k.double().transpose(-1, -2)
    if causal:
        sq, sk = s.shape[-2:]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1)  # j > i
        s = s.masked_fill(hidden, float("-inf"))
    return s


def ref_fwd(q, k, v, causal, scale):
    """float64 (out, lse): lse = logsumexp(s), out = softmax(s) @ v."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v.double(), lse


def ref_bwd(dout, q, k, v, out, lse, causal, scale):
    """float64 (dq, dk, dv) from the given out and lse (the formulas of block_attention_bwd)."""
    dout, q, k, v, out, lse = (t.double() for t in (dout, q, k, v, out, lse))
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])  # masked: exp(-inf) = 0
    dlt = (dout * out).sum(-1)
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - dlt[..., None])
    return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, dv


def assert_close(got, ref, tol, name):
    err = (got.double() - ref.double()).abs().max().item()
    mag = ref.double().abs().max().item()
    assert err <= tol * mag, f"{name}: max |err| {err:.3g} > {tol} * max |ref| {mag:.3g}"


def assert_lse_close(got, ref, name="lse"):
    assert got.dtype == torch.float32 and got.shape == ref.shape, (got.dtype, got.shape)
    err = (got.double() - ref.double()).abs().max().item()
    bound = LSE_TOL * max(1.0, ref.abs().max().item())
    assert err <= bound, f"{name}: max |err| {err:.3g} > {bound:.3g}"


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV).to(dtype)


def qkv(b, h, sq, sk, d, dtype):
    return randn(b, h, sq, d, dtype=dtype), randn(b, h, sk, d, dtype=dtype), \
        randn(b, h, sk, d, dtype=dtype)


# --------------------------------------------------------------------------- tests
def test_reference_backward_is_autograd():
    """The hand-written backward reference equals autograd of the forward reference (no Triton:
    it validates the yardstick the kernel tests use)."""
    q, k, v = (t.double().requires_grad_() for t in qkv(1, 2, 7, 9, 5, torch.float32))
    for causal in (False, True):
        out, lse = ref_fwd(q, k, v, causal, 0.4)
        dout = torch.randn_like(out)
        auto = torch.autograd.grad(out, (q, k, v), dout)
        mine = ref_bwd(dout, q, k, v, out.detach(), lse.detach(), causal, 0.4)
        for a, m in zip(auto, mine):
            torch.testing.assert_close(m, a, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) +
                         ("-causal" if c[5] else ""))
def test_forward_backward_vs_reference(case, dtype):
    b, h, sq, sk, d, causal = case
    q, k, v = qkv(b, h, sq, sk, d, dtype)
    scale = d ** -0.5
    out, lse = block_attention_fwd(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (b, h, sq)
    ref_out, ref_lse = ref_fwd(q, k, v, causal, scale)
    assert_close(out, ref_out, TOL[dtype], "out")
    assert_lse_close(lse, ref_lse)

    dout = randn(b, h, sq, d, dtype=dtype)
    grads = block_attention_bwd(dout, q, k, v, out, lse, causal, scale)
    refs = ref_bwd(dout, q, k, v, out, lse, causal, scale)  # same out, lse as the kernel's
    for name, g, r, like in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert g.shape == like.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        assert torch.isfinite(g).all(), name
        assert_close(g, r, TOL[dtype], name)


def _merge(parts):
    """Merge (out_i, lse_i) of key blocks: lse = logaddexp over i, out = sum exp(lse_i - lse)
    out_i (fp32)."""
    lse = parts[0][1]
    for _, l_i in parts[1:]:
        lse = torch.logaddexp(lse, l_i)
    out = sum(torch.exp(l_i - lse)[..., None] * o_i.float() for o_i, l_i in parts)
    return out, lse


def test_global_lse_split_keys():
    """k, v split in two ragged blocks along Sk: forward per block merged with logaddexp equals
    the full forward, and the backward per block with the MERGED out and lse gives dk, dv that
    concatenate (and dq that sums) to the full gradients."""
    b, h, sq, sk, d, cut = 2, 1, 33, 50, 40, 23
    q, k, v = qkv(b, h, sq, sk, d, torch.float32)
    scale = 0.3
    out, lse = block_attention_fwd(q, k, v, False, scale)
    dout = randn(b, h, sq, d)
    full = block_attention_bwd(dout, q, k, v, out, lse, False, scale)
    blocks = [(k[:, :, :cut], v[:, :, :cut]), (k[:, :, cut:], v[:, :, cut:])]
    m_out, m_lse = _merge([block_attention_fwd(q, kb, vb, False, scale) for kb, vb in blocks])
    assert_close(m_out, out, TOL[torch.float32], "merged out")
    assert_lse_close(m_lse, lse, "merged lse")
    g = [block_attention_bwd(dout, q, kb, vb, m_out, m_lse, False, scale) for kb, vb in blocks]
    ring = (g[0][0] + g[1][0], torch.cat([g[0][1], g[1][1]], 2), torch.cat([g[0][2], g[1][2]], 2))
    refs = ref_bwd(dout, q, k, v, *ref_fwd(q, k, v, False, scale), False, scale)
    for name, r, f, ref in zip(("dq", "dk", "dv"), ring, full, refs):
        assert_close(r, f, TOL[torch.float32], name + " vs full kernel")
        assert_close(r, ref, TOL[torch.float32], name + " vs reference")


def test_ring_causal_chunks():
    """Causal ring attention over a sequence cut into two ragged chunks (the same cut for q and
    k/v): query chunk a attends key chunk a causally (top-left aligned: chunk starts coincide)
    and earlier chunks fully. Merged outputs and gradients (backward per block with the merged
    out and lse of its query chunk) equal full causal attention."""
    b, h, s, d, cut = 1, 2, 37, 24, 20
    q, k, v = qkv(b, h, s, s, d, torch.float32)
    dout = randn(b, h, s, d)
    scale = d ** -0.5
    sl = [slice(0, cut), slice(cut, s)]
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    outs, lses = [], []
    for a in range(2):
        qa = q[:, :, sl[a]]
        pairs = [(bk, bk == a) for bk in range(a + 1)]
        m_out, m_lse = _merge([block_attention_fwd(qa, k[:, :, sl[bk]], v[:, :, sl[bk]], c,
                                                   scale) for bk, c in pairs])
        outs.append(m_out)
        lses.append(m_lse)
        for bk, c in pairs:
            gq, gk, gv = block_attention_bwd(dout[:, :, sl[a]], qa, k[:, :, sl[bk]],
                                             v[:, :, sl[bk]], m_out, m_lse, c, scale)
            dq[:, :, sl[a]] += gq
            dk[:, :, sl[bk]] += gk
            dv[:, :, sl[bk]] += gv
    ref_out, ref_lse = ref_fwd(q, k, v, True, scale)
    assert_close(torch.cat(outs, 2), ref_out, TOL[torch.float32], "ring out")
    assert_lse_close(torch.cat(lses, 2), ref_lse, "ring lse")
    refs = ref_bwd(dout, q, k, v, ref_out, ref_lse, True, scale)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert_close(g, r, TOL[torch.float32], "ring " + name)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_aten_cpu_flash(causal):
    """aten's CPU flash attention (forward and its backward with the given out, lse), fp32."""
    b, h, sq, sk, d = 1, 2, 37, 37, 24
    q, k, v = qkv(b, h, sq, sk, d, torch.float32)
    dout = randn(b, h, sq, d)
    scale = 0.25
    out, lse = block_attention_fwd(q, k, v, causal, scale)
    cpu = [t.cpu() for t in (q, k, v, dout)]
    a_out, a_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *cpu[:3], 0.0, causal, scale=scale)
    assert_close(out.cpu(), a_out, TOL[torch.float32], "out vs aten")
    assert_lse_close(lse.cpu(), a_lse, "lse vs aten")
    grads = block_attention_bwd(dout, q, k, v, out, lse, causal, scale)
    a_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        cpu[3], *cpu[:3], out.cpu(), lse.cpu(), 0.0, causal, scale=scale)
    for name, g, a in zip(("dq", "dk", "dv"), grads, a_grads):
        assert_close(g.cpu(), a, TOL[torch.float32], name + " vs aten")


def test_strided_inputs_equal_contiguous():
    """Inputs addressed through strides: q, dout as [B, S, H, D] transposed views, k with a
    non-unit last-dim stride, out as a view: bitwise the results of contiguous copies."""
    b, h, sq, sk, d = 1, 2, 19, 21, 24
    q = randn(b, sq, h, d).transpose(1, 2)
    k = randn(b, h, d, sk).transpose(2, 3)
    v = randn(b, h, sk, 2 * d)[..., ::2]
    dout = randn(b, sq, h, d).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    res = block_attention_fwd(q, k, v, True, 0.2)
    con = block_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), True, 0.2)
    assert all(torch.equal(x, y) for x, y in zip(res, con))
    out_view = res[0].transpose(1, 2).contiguous().transpose(1, 2)
    g = block_attention_bwd(dout, q, k, v, out_view, res[1], True, 0.2)
    gc = block_attention_bwd(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                             res[0], res[1], True, 0.2)
    for name, x, y in zip(("dq", "dk", "dv"), g, gc):
        assert torch.equal(x, y), name


@pytest.mark.skipif(not INTERP, reason="INTERPRET_CONFIG applies in the interpreter only")
@pytest.mark.parametrize("bm,bn", [(16, 32), (32, 16)])
def test_unequal_blocks(monkeypatch, bm, bn):
    """BLOCK_M != BLOCK_N: the causal loop bounds (key blocks skipped in the forward and dq,
    query blocks skipped in dk/dv) hold for any block pair, with Sq != Sk."""
    monkeypatch.setattr(attention, "INTERPRET_CONFIG", {"BLOCK_M": bm, "BLOCK_N": bn})
    b, h, sq, sk, d = 1, 1, 45, 39, 20
    q, k, v = qkv(b, h, sq, sk, d, torch.float32)
    dout = randn(b, h, sq, d)
    out, lse = block_attention_fwd(q, k, v, True, 0.3)
    ref_out, ref_lse = ref_fwd(q, k, v, True, 0.3)
    assert_close(out, ref_out, TOL[torch.float32], "out")
    assert_lse_close(lse, ref_lse)
    grads = block_attention_bwd(dout, q, k, v, out, lse, True, 0.3)
    for name, g, r in zip(("dq", "dk", "dv"), grads,
                          ref_bwd(dout, q, k, v, out, lse, True, 0.3)):
        assert_close(g, r, TOL[torch.float32], name)


def test_bad_inputs_raise_naming_shapes():
    q, k, v = qkv(1, 2, 8, 9, 16, torch.float32)
    with pytest.raises(TypeError, match=r"\(1, 2, 9, 16\)"):
        block_attention_fwd(q, k.to(torch.bfloat16), v, False, 1.0)
    with pytest.raises(ValueError, match=r"q \(1, 2, 8, 16\), k \(1, 2, 9, 24\)"):
        block_attention_fwd(q, randn(1, 2, 9, 24), randn(1, 2, 9, 24), False, 1.0)
    with pytest.raises(ValueError, match=r"v \(1, 2, 7, 16\)"):
        block_attention_fwd(q, k, randn(1, 2, 7, 16), False, 1.0)
    with pytest.raises(ValueError, match=r"4-D"):
        block_attention_fwd(q[0], k[0], v[0], False, 1.0)
    with pytest.raises(TypeError, match=r"float64"):
        block_attention_fwd(q.double(), k.double(), v.double(), False, 1.0)
    out, lse = block_attention_fwd(q, k, v, False, 1.0)
    with pytest.raises(ValueError, match=r"\(1, 2, 8\).*\(1, 2, 9\)"):
        block_attention_bwd(out, q, k, v, out, randn(1, 2, 9), False, 1.0)
    with pytest.raises(ValueError, match=r"\(1, 2, 8, 16\).*\(1, 2, 8, 8\)"):
        block_attention_bwd(out[..., :8], q, k, v, out, lse, False, 1.0)
    with pytest.raises(TypeError, match=r"\(1, 2, 9, 16\)"):
        block_attention_bwd(out, q, k, v.half(), out, lse, False, 1.0)
