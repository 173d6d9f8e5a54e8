"""Property tests: every compressor spec on every backend, on random shapes (0-d, empty, ragged,
huge-stride views), fp32/bf16/fp16, magnitudes from subnormal to the dtype's max, and NaN/Inf.

decompress(compress(x)) keeps shape and dtype, stays within the bound each format states in
its docstring (checked here exactly as stated), and never turns NaN/Inf into finite numbers
(the sparse formats refuse them instead, with "NaN/Inf" in the error).
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyfast.compress as C
from pyfast import perf
from pyfast.ops import status
from pyfast.ops import topk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KERNEL_SPECS = ["int8", "int4", "fp8", "sign", "topk:0.1"]  # the ones that run ops' backends
OTHER_SPECS = ["none", "fp16", "bf16", "randomk:0.3", "powersgd:2"]
FLT_MAX = torch.finfo(torch.float32).max
# the Triton interpreter runs kernels in numpy, which warns where fp32 1 / amax overflows or
# 0 * inf appears (what the format expects there, masked by the kernel: see Quantizer)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def backends():
    out = [pytest.param("torch")]
    for name in ("cpp", "triton"):
        ok, why = status(name, torch.device("cpu"))
        out.append(pytest.param(name, marks=pytest.mark.skipif(not ok, reason=why)))
    return out


# --------------------------------------------------------------------------- inputs
@st.composite
def tensors(draw, max_numel=1200):
    dtype = draw(st.sampled_from(DTYPES))
    fi = torch.finfo(dtype)
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 40 if ndim > 1 else max_numel), min_size=ndim,
                                max_size=ndim)))
    while math.prod(shape) > max_numel:
        shape = shape[:-1] + (shape[-1] // 2,)
    n = math.prod(shape)
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    # magnitudes: subnormal, tiny normal, ordinary, huge, up to the dtype's max
    top = draw(st.sampled_from([fi.smallest_normal / 64, fi.smallest_normal * 4, 1.0, 1e4,
                                fi.max / 4, fi.max]))
    v = torch.rand(n, generator=g, dtype=torch.float64) * top
    if draw(st.booleans()):  # heavy-tailed spread below `top`
        v = v * torch.exp2(-torch.randint(0, 24, (n,), generator=g).double())
    v = v * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    specials = draw(st.lists(st.tuples(st.integers(0, max(0, n - 1)), st.sampled_from(
        [0.0, -0.0, math.nan, math.inf, -math.inf, fi.max, -fi.max, fi.smallest_normal / 8])),
        max_size=3 if n else 0))
    for i, s in specials:
        v[i] = s
    flat = v.to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and len(shape) >= 2:  # same values, column-major storage
        return flat.view(shape).transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided" and n:
        # a huge-stride view: each element `step` apart (and reversed dims' strides)
        step = draw(st.sampled_from([7, 1 << 12, 1 << 16])) if n <= 64 else 3
        strides, acc = [], step
        for d in reversed(shape):
            strides.insert(0, acc)
            acc *= max(d, 1)
        base = torch.full((acc // step * step + 1,), math.nan, dtype=dtype)
        x = base.as_strided(shape, strides)
        x.copy_(flat.view(shape))
        return x
    return flat.view(shape)


# --------------------------------------------------------------------------- bounds
def rounding(dtype, mag):
    """Half an ulp of `dtype` at magnitude mag (and half its smallest subnormal): the error of
    the last rounding to the output dtype (0 for fp32: the formats compute in fp32)."""
    if dtype == torch.float32:
        return torch.zeros_like(mag)
    fi = torch.finfo(dtype)
    return mag * fi.eps / 2 + fi.smallest_normal * fi.eps / 2


def blocks(v, block=512):
    """Per element: its block's values view (nb, block) padded with 0, and the block index."""
    n = v.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block, dtype=v.dtype)
    padded[:n] = v
    return padded.view(nb, block), torch.arange(n) // block


def check(spec, c, x, p, y):
    assert y.shape == x.shape and y.dtype == x.dtype, spec
    xd, yd = x.reshape(-1).double(), y.reshape(-1).double()
    bad = ~xd.isfinite()
    assert not yd[bad].isfinite().any(), f"{spec}: NaN/Inf became finite"
    kind = spec.split(":")[0]
    if kind == "none":
        assert torch.equal(yd.nan_to_num(7.0), xd.nan_to_num(7.0))
    elif kind in ("fp16", "bf16"):
        w = torch.finfo(torch.float16 if kind == "fp16" else torch.bfloat16)
        over = ~bad & (xd.abs() >= (65520.0 if kind == "fp16" else (2 - 2 ** -8) * 2.0 ** 127))
        assert torch.equal(yd[over], xd[over].sign() * math.inf), f"{spec}: overflow is inf"
        ok = ~bad & ~over
        err = (yd - xd).abs()[ok]
        bound = xd.abs()[ok] * w.eps / 2 + w.smallest_normal * w.eps / 2
        if x.dtype != torch.float32 and torch.finfo(x.dtype) != w:
            bound = bound + rounding(x.dtype, xd.abs()[ok] + bound)
        assert (err <= bound).all(), f"{spec}: max excess {(err - bound).max()}"
    elif kind in ("int8", "int4", "fp8", "sign"):
        q = c.inner if isinstance(c, C.WithFeedback) else c
        xb, bi = blocks(xd, q.block)
        nonfinite_block = (~xb.isfinite()).any(1)[bi]
        assert yd[nonfinite_block].isnan().all(), f"{spec}: a block with NaN/Inf decodes to NaN"
        amax = xb.abs().amax(1)[bi]
        ok = ~nonfinite_block
        if kind == "sign":
            mean = xb.abs().sum(1)[bi] / torch.tensor([min(q.block, xd.numel() - b * q.block)
                                                      for b in range(xb.shape[0])]).double()[bi]
            total = xb.abs().sum(1)[bi]  # stated: a block whose fp32 sum overflows is NaN
            assert yd[ok & (total > FLT_MAX * (1 + 2 ** -10))].isnan().all()
            ok = ok & (total < FLT_MAX * (1 - 2 ** -10))  # between: rounding decides
            m = mean[ok]
            slack = m * 2 ** -14 + 2.0 ** -140
            assert ((yd[ok].abs() - m).abs() <= slack + rounding(x.dtype, m + slack)).all(), \
                f"{spec}: |y| is the block's mean |x|"
            pos = ok & (mean > 0)
            assert torch.equal(yd[pos] < 0, xd[pos] < 0), f"{spec}: signs"
            return
        qmax = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}[kind]
        step = amax / qmax
        half = 1.0 if q.stochastic else 0.5  # stochastic rounding: within one step
        if kind == "fp8":
            bound = xd.abs() * (2 * half * 2 ** -4 + 2 ** -20) + (2 * half * 2 ** -10 + 2 ** -14) * step
        else:
            bound = (half + 2 ** -14) * step
        bound = bound + qmax * 2.0 ** -128
        bound = bound + rounding(x.dtype, xd.abs() + bound)
        err = (yd - xd).abs()
        assert (err[ok] <= bound[ok]).all(), \
            f"{spec}: max excess {(err[ok] - bound[ok]).max()} at {int((err - bound)[ok].argmax())}"
    elif kind in ("topk", "randomk"):
        sent = torch.zeros(xd.numel(), dtype=torch.bool)
        if kind == "topk":
            sent[p.tensors["indices"].long()] = True
        else:
            sent[q_indices(c, p)] = True
        assert torch.equal(yd[sent], xd[sent]), f"{spec}: sent values are exact"
        assert (yd[~sent] == 0).all()
        if kind == "topk" and xd.numel():
            k, lo, hi = topk.target(xd.numel(), float(spec.split(":")[1]))
            assert lo <= int(sent.sum()) <= hi
            if (~sent).any():
                assert xd[sent].abs().min() >= xd[~sent].abs().max(), f"{spec}: the largest"
    elif kind == "powersgd":
        inner = c.inner if isinstance(c, C.WithFeedback) else c
        if not inner.compressible(x):
            assert torch.equal(yd.nan_to_num(7.0), xd.nan_to_num(7.0))
            return
        norm = float(xd[~bad].norm()) if (~bad).any() else 0.0
        if bad.any() or norm >= min(torch.finfo(x.dtype).max / 2, 2.0 ** 100):
            return  # the stated bound is for finite x whose norm cannot overflow
        err = float((yd - xd).norm())
        assert err <= norm * (1 + 1e-4) + 2.0 ** -120 * math.sqrt(xd.numel()) + \
            float(rounding(x.dtype, yd.abs()).norm()), f"{spec}: {err} > |x| = {norm}"


def q_indices(c, p):
    r = c.inner if isinstance(c, C.WithFeedback) else c
    return r.indices(p.numel, p.meta["seed"], p.tensors["values"].device).long()


def round_trip(spec, x, **options):
    c = C.get(spec, **options)
    try:
        p = c.compress(x, "w")
    except ValueError as e:
        refused = spec.startswith(("topk", "randomk")) and not torch.isfinite(x).all()
        assert refused and "NaN/Inf" in str(e), f"{spec}: unexpected refusal {e}"
        return None
    y = c.decompress(p)
    check(spec, c, x, p, y)
    out = torch.full_like(x, math.nan)  # same values through decompress(p, out)
    assert c.decompress(p, out=out) is out
    assert torch.equal(out.nan_to_num(7.0), y.nan_to_num(7.0))
    return c, p, y


# --------------------------------------------------------------------------- properties
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("spec", KERNEL_SPECS)
def test_kernel_formats(spec, backend):
    small = backend == "triton"  # the interpreter: tiny sizes, fewer cases

    @settings(max_examples=15 if small else 40, **SETTINGS)
    @given(x=tensors(max_numel=600 if small else 1200))
    def prop(x):
        with perf.backend(backend):
            round_trip(spec, x)

    prop()


@pytest.mark.parametrize("spec,options", [("int8", {"stochastic": True}),
                                          ("fp8", {"stochastic": True}),
                                          ("int4", {"block": 32})])
def test_quantizer_options(spec, options):
    @settings(max_examples=25, **SETTINGS)
    @given(x=tensors())
    def prop(x):
        round_trip(spec, x, **options)

    prop()


@pytest.mark.parametrize("spec", OTHER_SPECS)
def test_other_formats(spec):
    @settings(max_examples=40, **SETTINGS)
    @given(x=tensors())
    def prop(x):
        round_trip(spec, x)

    prop()


@pytest.mark.parametrize("spec", KERNEL_SPECS + OTHER_SPECS)
def test_error_feedback(spec):
    """compress through error feedback: the payload decodes within the format's bound of
    x + ef (as x's dtype), what was sent plus what is remembered is x + ef (fp32 rounding),
    and NaN/Inf is refused or stays non-finite in both."""
    @settings(max_examples=25, **SETTINGS)
    @given(x=tensors(max_numel=700))
    def prop(x):
        c = C.WithFeedback(C.get(spec))
        for step in (x, x.reshape(-1).roll(1).view(x.shape)):  # two steps, two residuals
            ef = c.feedback.memory.get("w")
            before = ef.clone() if ef is not None else torch.zeros(x.numel())
            try:
                p = c.compress(step, "w")
            except ValueError as e:
                assert "NaN/Inf" in str(e) and not (step.float().reshape(-1) + before).isfinite().all()
                return
            after = c.feedback.memory["w"]
            r = step.reshape(-1).float() + before
            sent = c.decompress(p).reshape(-1).float()
            finite = r.isfinite()
            assert not sent[~finite].isfinite().any() or spec.startswith("powersgd")
            assert not after[~finite].isfinite().any() or spec == "none"
            fin = finite & sent.isfinite() & after.isfinite()
            # ef' = fp32(r - sent): one rounding, so sent + ef' is r within half an ulp of r - sent
            s_, a_, r_ = sent[fin].double(), after[fin].double(), r[fin].double()
            assert ((s_ + a_ - r_).abs() <= (r_ - s_).abs() * 2 ** -24 + 2.0 ** -150).all(), spec

    prop()
