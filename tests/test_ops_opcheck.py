"""torch.library.opcheck on every pyfast op: schema (mutation / aliasing annotations), fake
implementations (pyfast/ops/_fake.py) against the real kernels, and torch.compile's dynamic-shape
tracing. Runs the CPU kernels of pyfast._C, so it is skipped when the extension is not built.
"""
import pytest
import torch

from pyfast.ops import quantize
from pyfast.ops import status

ok, why = status("cpp", torch.device("cpu"))
pytestmark = pytest.mark.skipif(not ok, reason=why)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 1000, 70_001]  # one element, odd tails, and past the serial cut-off (64K)
KINDS = ["int8", "int4", "fp8", "sign", "nf4"]


def sample(n, dtype):
    x = torch.randn(n) * torch.exp(torch.randn(n).clamp(-3, 3))
    return torch.where(x == 0, torch.ones_like(x), x).to(dtype)  # random and non-zero


def ops():
    return torch.ops.pyfast


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_opcheck_quantize(kind, n, dtype):
    x = sample(n, dtype)
    block = 64 if n < 1000 else 512
    torch.library.opcheck(ops().quantize.default, (x, kind, block, False, 0))
    if kind not in ("sign", "nf4"):  # neither has stochastic rounding
        torch.library.opcheck(ops().quantize.default, (x, kind, block, True, 7))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_opcheck_dequantize(kind, n, dtype):
    codes, scales = quantize.quantize_ref(sample(n, torch.float32), kind, 512)
    torch.library.opcheck(ops().dequantize.default, (codes, scales, n, kind, 512, dtype))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_opcheck_dequantize_accumulate(kind, n):
    codes, scales = quantize.quantize_ref(sample(n, torch.float32), kind, 512)
    out = torch.randn(n)
    torch.library.opcheck(ops().dequantize_accumulate_.default, (out, codes, scales, kind, 512))


@pytest.mark.parametrize("with_ef", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_opcheck_topk(n, dtype, with_ef):
    x = sample(n, dtype)
    ef = torch.randn(n) * 0.1 if with_ef else None
    t = float(x.float().abs().quantile(0.9)) if n > 1 else 0.5
    torch.library.opcheck(ops().topk_count.default, (x, ef, t))
    limit = max(1, n // 20)  # below the ~n/10 count for n > 1: the cap is exercised
    torch.library.opcheck(ops().topk_select.default, (x, ef, t, limit))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_opcheck_ternary(n, dtype):
    if not hasattr(ops(), "ternary_encode"):
        pytest.skip("pyfast._C was built before csrc/ternary.cpp: run `make install`")
    x = sample(n, dtype)
    block = 64 if n < 1000 else 512
    torch.library.opcheck(ops().ternary_encode.default, (x, block, 7))
    codes, scales = ops().ternary_encode(x, block, 7)
    torch.library.opcheck(ops().ternary_decode.default, (codes, scales, n, block, dtype))
