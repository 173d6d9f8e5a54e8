"""The C++ and Triton quantize kernels against the torch reference (docs/FORMATS.md).

Codes and int8/int4/fp8 scales are compared bitwise (max is order-free and every other step is
one IEEE fp32 operation). sign's scale is a mean over the block: a 512-term fp32 sum in another
order may differ by up to (512 - 1) * 2^-24 ~ 3.1e-5 relative, so scales and the values they
decode to are compared with rtol=3.1e-5.
"""
import pytest
import torch

from conftest import backend_params
from pyfast.ops import quantize

# 100_003: many Triton programs and a ragged tail; 1_000_003: the C++ kernels' threads
SIZES = [1, 1023, 1025, 100_003, 1_000_003]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["int8", "int4", "fp8", "sign"]
SIGN_RTOL = 3.1e-5


def sample(n, dtype):
    # Gaussian with a few large outliers: every block gets a different scale
    x = torch.randn(n) * torch.exp(torch.randn(n).clamp(-3, 3))
    return x.to(dtype)


def too_slow(backend, n, dtype):
    # the Triton interpreter runs ~1 ms per program: its million-element fp32 cases took 14-49 s
    # each under load, so Triton takes its many-program case at 100_003 (196 blocks of 512)
    return backend == "triton" and (n > 200_000 or n > 100_000 and dtype != torch.float32)


def assert_scales(kind, got, ref):
    if kind == "sign":
        torch.testing.assert_close(got, ref, rtol=SIGN_RTOL, atol=0)
    else:
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_matches_reference(backend, kind, n, dtype):
    if too_slow(backend, n, dtype):
        pytest.skip("interpreter: the many-program case is n = 100_003, float32")
    x = sample(n, dtype)
    codes, scales = quantize.quantize(x, kind, backend=backend)
    rc, rs = quantize.quantize_ref(x, kind)
    assert codes.dtype == torch.uint8 and codes.numel() == quantize.codes_len(n, kind)
    assert torch.equal(codes, rc), f"{(codes != rc).sum()} of {rc.numel()} codes differ"
    assert_scales(kind, scales, rs)
    for out_dtype in (torch.float32, dtype):
        y = quantize.dequantize(codes, scales, n, kind, dtype=out_dtype, backend=backend)
        ry = quantize.dequantize_ref(codes, scales, n, kind, dtype=out_dtype)
        assert y.dtype == out_dtype and y.shape == (n,)
        assert torch.equal(y, ry)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("n", [1, 1025, 70_001])
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_accumulate(backend, kind, n):
    x = sample(n, torch.float32)
    codes, scales = quantize.quantize_ref(x, kind)
    out = torch.randn(n)
    ref = out + quantize.dequantize_ref(codes, scales, n, kind)
    quantize.dequantize_accumulate_(out, codes, scales, kind, backend=backend)
    assert torch.equal(out, ref)  # one fp32 add of the same two numbers


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_stochastic_matches_reference(backend, kind, dtype):
    # the counter-based hash makes stochastic codes reproducible across backends too
    x = sample(3001, dtype)
    codes, scales = quantize.quantize(x, kind, stochastic=True, seed=1234, backend=backend)
    rc, rs = quantize.quantize_ref(x, kind, stochastic=True, seed=1234)
    assert torch.equal(codes, rc) and torch.equal(scales, rs)
    other, _ = quantize.quantize(x, kind, stochastic=True, seed=1235, backend=backend)
    assert not torch.equal(codes, other), "the seed must change the rounding"


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_stochastic_rounding_is_unbiased(kind):
    # mean of 400 seeded decodes -> x; each decode's error is at most one step (scale for
    # int*, 1/8 relative for fp8), so the mean's error shrinks like 1/sqrt(400) = 0.05 step
    x = sample(2048, torch.float32)
    codes, scales = quantize.quantize(x, kind)
    step = scales.repeat_interleave(quantize.DEFAULT_BLOCK)[:2048]
    if kind == "fp8":
        step = x.abs() / 8 + step * 2 ** -9
    mean = torch.stack([quantize.dequantize(*quantize.quantize(x, kind, stochastic=True, seed=s),
                                            2048, kind)
                        for s in range(400)]).mean(0)
    rn = quantize.dequantize(codes, scales, 2048, kind)
    assert ((mean - x).abs() / step).mean() < 0.06
    assert ((rn - x).abs() / step).mean() > 0.1  # while a single rounding is off by more


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_edge_inputs(backend, kind):
    empty = torch.empty(0)
    codes, scales = quantize.quantize(empty, kind, backend=backend)
    assert codes.numel() == 0 and scales.numel() == 0
    assert quantize.dequantize(codes, scales, 0, kind, backend=backend).numel() == 0
    zeros = torch.zeros(1500, dtype=torch.bfloat16)
    codes, scales = quantize.quantize(zeros, kind, backend=backend)
    y = quantize.dequantize(codes, scales, 1500, kind, backend=backend)
    assert torch.equal(scales, torch.zeros(3)) and torch.equal(y, torch.zeros(1500))
    base = sample(4096, torch.float32).view(64, 64)
    nc = base.t()[:, ::2]  # not contiguous
    assert not nc.is_contiguous()
    c1, s1 = quantize.quantize(nc, kind, backend=backend)
    c2, s2 = quantize.quantize_ref(nc.contiguous(), kind)
    assert torch.equal(c1, c2)


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("kind", KINDS)
def test_nonfinite_input_decodes_to_nan(backend, kind, bad):
    x = sample(2000, torch.float32)
    x[700] = bad  # block 1 of [0, 512), [512, 1024), ...
    codes, scales = quantize.quantize(x, kind, backend=backend)
    y = quantize.dequantize(codes, scales, 2000, kind, backend=backend)
    assert y[512:1024].isnan().all(), "a non-finite block must decode to NaN, not numbers"
    assert torch.isfinite(y[:512]).all() and torch.isfinite(y[1024:]).all()


def test_bad_arguments():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="kind"):
        quantize.quantize(x, "int3")
    with pytest.raises(ValueError, match="power of two"):
        quantize.quantize(x, "int8", block=100)
    with pytest.raises(TypeError, match="float64"):
        quantize.quantize(x.double(), "int8")
    codes, scales = quantize.quantize_ref(x, "int4")
    with pytest.raises(ValueError, match="uint8"):
        quantize.dequantize(codes[:-1], scales, 100, "int4")
    with pytest.raises(TypeError, match="codes .* must be uint8"):  # a dtype: TypeError
        quantize.dequantize(codes.to(torch.int8), scales, 100, "int4")
    with pytest.raises(TypeError, match="scales .* must be float32"):
        quantize.dequantize(codes, scales.half(), 100, "int4")
    with pytest.raises(TypeError, match="float32"):
        quantize.dequantize_accumulate_(torch.zeros(100, dtype=torch.float16), codes, scales,
                                        "int4")
    with pytest.raises(ValueError, match="non-contiguous"):
        quantize.dequantize_accumulate_(torch.zeros(200)[::2], codes, scales, "int4")
    with pytest.raises(ValueError, match="stochastic"):
        quantize.quantize(x, "sign", stochastic=True)
