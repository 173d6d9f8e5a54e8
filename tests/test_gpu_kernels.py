"""pyfast's CUDA fast paths (pyfast._C's csrc/cuda kernels and the compiled Triton kernels)
against the torch reference, on a real GPU. Skipped where torch sees no CUDA device (every CI
machine); run on a GPU with `PYFAST_TEST_GPU=1 pytest tests/test_gpu_kernels.py` (tools/gpu_check.sh).

Inputs are drawn on the CPU, the reference runs on the CPU, the kernel on CUDA. The formats are
exact by construction (docs/FORMATS.md: max-based scales, one IEEE fp32 multiply and
round-to-nearest-even per element, a counter hash for stochastic rounding; top-k selects
|x + ef| >= t with one fp32 add), so codes, int8/int4/fp8 scales, values, indices and the
error-feedback memory are compared bitwise; sign's scale is a 512-term mean whose summation
order differs (rtol 3.1e-5 = 511 * 2^-24, as tests/test_ops_quantize.py).
"""
import pytest
import torch

import pyfast.compress as C
from pyfast.ops import quantize, status, topk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")
SIZES = [1, 1023, 1025, 1_000_003]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["int8", "int4", "fp8", "sign", "nf4"]
SIGN_RTOL = 3.1e-5


def backends():
    out = []
    for name in ("cpp", "triton"):
        ok, why = status(name, CUDA) if torch.cuda.is_available() else (False, "no CUDA")
        out.append(pytest.param(name, marks=pytest.mark.skipif(not ok, reason=why)))
    return out


def sample(n, dtype):
    x = torch.randn(n) * torch.exp(torch.randn(n).clamp(-3, 3))  # every block its own scale
    return x.to(dtype)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_on_cuda_matches_reference(backend, kind, n, dtype):
    x = sample(n, dtype)
    codes, scales = quantize.quantize(x.to(CUDA), kind, backend=backend)
    rc, rs = quantize.quantize_ref(x, kind)
    assert codes.device.type == "cuda" and scales.device.type == "cuda"
    assert torch.equal(codes.cpu(), rc), f"{(codes.cpu() != rc).sum()} of {rc.numel()} differ"
    if kind == "sign":
        torch.testing.assert_close(scales.cpu(), rs, rtol=SIGN_RTOL, atol=0)
    else:
        assert torch.equal(scales.cpu().view(torch.int32), rs.view(torch.int32))
    for out_dtype in (torch.float32, dtype):
        y = quantize.dequantize(codes, scales, n, kind, dtype=out_dtype, backend=backend)
        ry = quantize.dequantize_ref(codes.cpu(), scales.cpu(), n, kind, dtype=out_dtype)
        assert y.device.type == "cuda" and torch.equal(y.cpu(), ry)
        out = torch.full((n,), float("nan"), dtype=out_dtype, device=CUDA)
        quantize.dequantize(codes, scales, n, kind, dtype=out_dtype, backend=backend, out=out)
        assert torch.equal(out.cpu(), ry)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("n", [1, 1025, 70_001])
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_accumulate_on_cuda(backend, kind, n):
    codes, scales = quantize.quantize_ref(sample(n, torch.float32), kind)
    out = torch.randn(n)
    ref = out + quantize.dequantize_ref(codes, scales, n, kind)
    got = out.to(CUDA)
    quantize.dequantize_accumulate_(got, codes.to(CUDA), scales.to(CUDA), kind, backend=backend)
    assert torch.equal(got.cpu(), ref)  # one fp32 add of the same two numbers


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_stochastic_on_cuda_matches_reference(backend, kind, dtype):
    x = sample(100_003, dtype)
    codes, scales = quantize.quantize(x.to(CUDA), kind, stochastic=True, seed=77,
                                      backend=backend)
    rc, rs = quantize.quantize_ref(x, kind, stochastic=True, seed=77)
    assert torch.equal(codes.cpu(), rc) and torch.equal(scales.cpu(), rs)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_ef", [False, True], ids=["plain", "ef"])
def test_topk_on_cuda_matches_reference(backend, n, dtype, with_ef):
    x = (torch.randn(n) * torch.exp(2 * torch.randn(n))).to(dtype)
    ef = torch.randn(n) * 0.1 if with_ef else None
    t = float(x.float().abs().quantile(0.9)) if n > 1 else 0.5
    got = topk.topk_count(x.to(CUDA), ef.to(CUDA) if with_ef else None, t, backend=backend)
    assert torch.equal(got.cpu(), topk.topk_count_ref(x, ef, t))
    limit = max(1, int(got[0]) - 3)  # the cap must cut the selection in index order
    ef_gpu = ef.to(CUDA) if with_ef else None
    v, i = topk.topk_select(x.to(CUDA), ef_gpu, t, limit, backend=backend)
    rv, ri = topk.topk_select_ref(x, ef, t, limit)
    assert torch.equal(i.cpu(), ri) and torch.equal(v.cpu(), rv)
    if with_ef:
        assert torch.equal(ef_gpu.cpu(), ef)


@pytest.mark.parametrize("spec", ["bf16", "fp8", "int8", "int4", "sign", "topk:0.01",
                                  "powersgd:4"])
def test_compressors_on_cuda_keep_the_device_and_match_the_cpu(spec):
    """A whole compressor on a CUDA gradient: payload and result stay on the GPU (no host round
    trip) and decode to the CPU path's values (bitwise for the exact formats; PowerSGD's
    matmuls and QR differ between cuBLAS/cuSOLVER and the CPU: rel 1e-4 of the norm)."""
    x = torch.randn(4096, 257) * torch.exp(torch.randn(4096, 257).clamp(-2, 2))
    cg, cc = C.get(spec), C.get(spec)
    yg = cg.decompress(cg.compress(x.to(CUDA), "g"))
    yc = cc.decompress(cc.compress(x, "g"))
    assert yg.device.type == "cuda" and yg.shape == yc.shape
    if spec.startswith("powersgd"):
        assert float((yg.cpu() - yc).norm()) <= 1e-4 * float(yc.norm())
    elif spec == "sign":
        torch.testing.assert_close(yg.cpu(), yc, rtol=SIGN_RTOL, atol=0)
    else:
        assert torch.equal(yg.cpu(), yc)


def _linear_case(xshape, out, act, dtype):
    from test_ops_linear import assert_all_close, inputs, run
    from pyfast.ops import linear
    x, w, b = inputs(xshape, out, dtype)
    dy = torch.randn(*xshape[:-1], out).to(dtype)
    got = run(linear.linear_act, *(t.to(CUDA) for t in (x, w, b)), act, dy.to(CUDA),
              backend="triton")
    assert all(g.device.type == "cuda" for g in got)
    # the reference on the CPU: its fp32 GEMM never rounds to tf32
    assert_all_close([g.cpu() for g in got], run(linear.linear_act_ref, x, w, b, act, dy),
                     dtype, x, w, b, dy)


@pytest.mark.skipif(not status("triton", CUDA)[0] if torch.cuda.is_available() else True,
                    reason="no CUDA device or no triton")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh"])
@pytest.mark.parametrize("xshape,out", [((5, 17), 33), ((3, 7, 65), 31), ((2, 35, 48), 70),
                                        ((1000, 1024), 1536), ((2, 300, 769), 1031)])
def test_triton_linear_on_cuda(xshape, out, act, dtype):
    """linear_act's compiled Triton GEMMs (autotuned tiles, forward and backward) against the
    reference, within test_ops_linear's bound (relative to the sum of the terms' magnitudes).
    fp32 follows torch's allow_tf32 (off by default): "ieee" dots."""
    _linear_case(xshape, out, act, dtype)
