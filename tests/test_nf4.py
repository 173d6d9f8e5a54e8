"""nf4 (QLoRA's NormalFloat4, docs/FORMATS.md): the codebook and thresholds, quantize against a
brute-force nearest-entry reference, dequantize against codebook[code] * absmax, the C++ and
Triton kernels against the torch reference bit for bit, the round-trip bound, QuantLinear's nf4
path, and bitsandbytes' own NF4 where it is installed. Small sizes: Triton runs interpreted.
"""
import struct
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import backend_params
from pyfast.ops import quantize, status

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 2, 63, 64, 65, 7000, 70_001]  # odd, one block, ragged, past the serial cut-off
BLOCKS = [32, 64, 512]
# Half the largest gap between neighbouring entries: -1 and -0.6961928 (QLoRA's tail bins).
HALF_GAP = max(b - a for a, b in zip(quantize.NF4_CODEBOOK, quantize.NF4_CODEBOOK[1:])) / 2


def available() -> list[str]:
    return ["torch"] + [b for b in ("cpp", "triton") if status(b, torch.device("cpu"))[0]]


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def sample(n, dtype):
    x = torch.randn(n) * torch.exp(torch.randn(n).clamp(-3, 3))  # every block its own absmax
    return x.to(dtype)


def codes_of(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The n codes (int64) of packed bytes: element 2j in the low nibble of byte j."""
    c = packed.to(torch.int64)
    return torch.stack([c & 0xF, c >> 4], 1).reshape(-1)[:n]


def brute_force_codes(x: torch.Tensor, block: int) -> torch.Tensor:
    """Independent of quantize_ref: y = x * (1 / absmax) in fp32 (FORMATS.md), then the entry
    at the least float64 distance (exact where a tie is close: y then has the magnitude of its
    neighbouring entries), the smaller entry on a tie (argmin takes the first)."""
    xf = x.reshape(-1).float()
    n = xf.numel()
    amax = F.pad(xf.abs(), (0, -n % block)).view(-1, block).amax(1)
    inv = torch.where(amax > 0, amax.reciprocal(), torch.zeros_like(amax))
    y = (xf * inv.repeat_interleave(block)[:n]).double()
    book = torch.tensor(quantize.NF4_CODEBOOK, dtype=torch.float64)
    return (y[:, None] - book[None, :]).abs().argmin(1)


def test_codebook_and_thresholds():
    book = quantize.NF4_CODEBOOK
    assert len(book) == 16 and book[0] == -1.0 and book[7] == 0.0 and book[15] == 1.0
    assert all(f32(v) == v for v in book), "every entry is an exact float32"
    assert list(book) == sorted(book)
    for k, t in enumerate(quantize.NF4_THRESHOLDS):
        mid = (Fraction(book[k]) + Fraction(book[k + 1])) / 2
        assert f32(t) == t and Fraction(t) <= mid
        up = torch.tensor(t, dtype=torch.float32).nextafter(torch.tensor(2.0)).item()
        assert Fraction(up) > mid, f"threshold {k} is not the largest float32 <= the midpoint"
    assert quantize.FORMATS["nf4"].per_byte == 2 and quantize.FORMATS["nf4"].qmax == 1.0


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", [1, 65, 7000])
def test_reference_is_the_nearest_entry(n, block):
    x = sample(n, torch.float32)
    codes, scales = quantize.quantize_ref(x, "nf4", block)
    assert torch.equal(codes_of(codes, n), brute_force_codes(x, block))
    amax = F.pad(x.abs(), (0, -n % block)).view(-1, block).amax(1)
    assert torch.equal(scales, amax), "the scale is the block's absmax"


def test_exact_midpoints_and_neighbours():
    # one block with absmax 1 (so y = x exactly): every codebook entry, every threshold, the
    # exact midpoints where representable (ties: the smaller entry), one ulp either side
    book = torch.tensor(quantize.NF4_CODEBOOK)
    t = torch.tensor(quantize.NF4_THRESHOLDS)
    vals = torch.cat([book, t, t.nextafter(t + 1), t.nextafter(t - 1),
                      book.nextafter(book + 1).clamp(max=1), book.nextafter(book - 1).clamp(min=-1),
                      torch.tensor([-0.0, 1e-30, -1e-30])])
    x = torch.cat([torch.tensor([1.0]), vals])
    got = codes_of(quantize.quantize_ref(x, "nf4", 64 if x.numel() <= 64 else 128)[0], x.numel())
    assert torch.equal(got, brute_force_codes(x, 64 if x.numel() <= 64 else 128))
    exact = [k for k in range(15) if Fraction(quantize.NF4_THRESHOLDS[k])
             == (Fraction(quantize.NF4_CODEBOOK[k]) + Fraction(quantize.NF4_CODEBOOK[k + 1])) / 2]
    assert exact, "some midpoints are exact float32: the tie rule is exercised"
    ties = quantize.quantize_ref(torch.tensor([1.0] + [quantize.NF4_THRESHOLDS[k] for k in exact]),
                                 "nf4", 32)[0]
    assert codes_of(ties, len(exact) + 1)[1:].tolist() == exact  # the smaller entry, code k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_is_codebook_times_absmax(dtype):
    n, block = 7000, 64
    codes = torch.randint(0, 256, (quantize.codes_len(n, "nf4"),), dtype=torch.uint8)
    scales = torch.rand(quantize.scales_len(n, block)) * 10
    book = torch.tensor(quantize.NF4_CODEBOOK, dtype=torch.float32)
    want = (book[codes_of(codes, n)] * scales.repeat_interleave(block)[:n]).to(dtype)
    for backend in available():
        got = quantize.dequantize(codes, scales, n, "nf4", block, dtype, backend=backend)
        assert torch.equal(got, want), backend


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_kernels_match_reference(backend, n, dtype, block):
    if backend == "triton" and n > 10_000 and (dtype != torch.float32 or block != 64):
        pytest.skip("interpreter: the 70K case once")
    x = sample(n, dtype)
    codes, scales = quantize.quantize(x, "nf4", block, backend=backend)
    rc, rs = quantize.quantize_ref(x, "nf4", block)
    assert codes.numel() == quantize.codes_len(n, "nf4") == (n + 1) // 2
    assert torch.equal(codes, rc), f"{(codes != rc).sum()} of {rc.numel()} code bytes differ"
    assert torch.equal(scales.view(torch.int32), rs.view(torch.int32))
    for out_dtype in {torch.float32, dtype}:
        y = quantize.dequantize(codes, scales, n, "nf4", block, out_dtype, backend=backend)
        assert torch.equal(y, quantize.dequantize_ref(codes, scales, n, "nf4", block, out_dtype))
        out = torch.full((n,), float("nan"), dtype=out_dtype)
        quantize.dequantize(codes, scales, n, "nf4", block, out_dtype, backend=backend, out=out)
        assert torch.equal(out, y)
    acc = torch.randn(n)
    want = acc + quantize.dequantize_ref(codes, scales, n, "nf4", block)
    quantize.dequantize_accumulate_(acc, codes, scales, "nf4", block, backend=backend)
    assert torch.equal(acc, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bound(dtype):
    # |dequantize(quantize(x)) - x| <= (HALF_GAP + 2^-21) * absmax: half the widest gap, plus
    # the fp32 roundings of 1 / absmax, x * inv and code value * absmax (output fp32)
    n, block = 70_001, 64
    x = sample(n, dtype)
    codes, scales = quantize.quantize(x, "nf4", block)
    y = quantize.dequantize(codes, scales, n, "nf4", block)
    amax = scales.repeat_interleave(block)[:n]
    err = (y - x.float()).abs()
    assert (err <= amax * (HALF_GAP + 2 ** -21)).all()
    assert (err / amax).max() > 0.9 * HALF_GAP, "the bound is tight (the tail bins)"
    assert torch.equal(y[x.float().abs() == amax], x.float()[x.float().abs() == amax]), \
        "each block's absmax decodes exactly (code 0 or 15: -1 or 1 times absmax)"


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
def test_edge_blocks(backend):
    zeros = torch.zeros(129, dtype=torch.bfloat16)
    codes, scales = quantize.quantize(zeros, "nf4", 64, backend=backend)
    assert torch.equal(scales, torch.zeros(3)) and (codes[:64] == 0x77).all()  # code 7: 0.0
    assert codes[64] == 0x07, "the pad nibble of an odd n is 0"
    assert torch.equal(quantize.dequantize(codes, scales, 129, "nf4", 64, backend=backend),
                       torch.zeros(129))
    empty = quantize.quantize(torch.empty(0), "nf4", 64, backend=backend)
    assert empty[0].numel() == 0 and empty[1].numel() == 0
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = sample(301, torch.float32)
        x[100] = bad  # block 1 of 64
        codes, scales = quantize.quantize(x, "nf4", 64, backend=backend)
        rc, rs = quantize.quantize_ref(x, "nf4", 64)
        assert torch.equal(codes, rc) and torch.equal(scales.isnan(), rs.isnan())
        y = quantize.dequantize(codes, scales, 301, "nf4", 64, backend=backend)
        assert y[64:128].isnan().all() and torch.isfinite(y[:64]).all() and \
            torch.isfinite(y[128:]).all()
        assert (codes[32:64] == 0).all(), "a non-finite block codes 0, as every kind"
    tiny = torch.tensor([1e-39, -1e-40, 0.0, 3e-39] * 16)  # 1 / absmax overflows
    c1, s1 = quantize.quantize(tiny, "nf4", 64, backend=backend)
    c2, s2 = quantize.quantize_ref(tiny, "nf4", 64)
    assert torch.equal(c1, c2) and torch.equal(s1, s2)


def test_refusals():
    x = torch.randn(100)
    for backend in available():
        with pytest.raises((ValueError, RuntimeError), match="nf4 has no stochastic"):
            quantize.quantize(x, "nf4", 64, stochastic=True, backend=backend)
    import pyfast.compress as C
    from pyfast.compress.quant import Quantizer
    if status("cpp", torch.device("cpu"))[0]:  # the op itself refuses too
        with pytest.raises(RuntimeError, match="nf4 has no stochastic"):
            torch.ops.pyfast.quantize(x, "nf4", 64, True, 0)
    with pytest.raises(ValueError, match="frozen weights"):
        Quantizer("nf4")
    with pytest.raises(ValueError, match="unknown compressor spec"):
        C.get("nf4")


@pytest.mark.parametrize("bias", [True, False])
def test_quant_linear_nf4(bias):
    from pyfast.models.quant_base import QuantLinear
    lin = nn.Linear(100, 70, bias=bias)  # 7000 weights: not a multiple of 64
    q = QuantLinear(lin, "nf4")
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == 3500
    assert q.scales.numel() == 110 and not q.codes.requires_grad
    w = q.dequantized()
    assert torch.equal(w.view(-1), quantize.dequantize_ref(q.codes, q.scales, 7000, "nf4", 64))
    x = torch.randn(3, 5, 100)
    torch.testing.assert_close(q(x), F.linear(x, w, lin.bias), rtol=0, atol=0)
    assert (w - lin.weight).abs().max() <= (HALF_GAP + 2 ** -21) * lin.weight.abs().max()
    xb = x.bfloat16()
    assert q(xb).dtype == torch.bfloat16
    torch.testing.assert_close(q(xb), F.linear(xb, q.dequantized(torch.bfloat16),
                                               None if lin.bias is None else lin.bias.bfloat16()))
    bits = 8 * (q.codes.numel() + 4 * q.scales.numel()) / 7000
    assert bits <= 4.6 and 16 / bits >= 3.5, "vs bf16: >= 3.5x fewer bytes"


def test_lora_over_an_nf4_base():
    # QLoRA in small: adapters over an nf4 base train (gradients reach them only), and the
    # model computes what the same model with the dequantized weights in plain Linears does
    from pyfast.models.lora import LoraOptions, apply_lora
    from pyfast.models.quant_base import QuantLinear, quantize_base
    model = nn.Sequential(nn.Linear(100, 70), nn.GELU(), nn.Linear(70, 33))
    apply_lora(model, LoraOptions(rank=4, targets=("0", "2")))
    for m in model.modules():
        if hasattr(m, "lora_B"):
            nn.init.normal_(m.lora_B["default"].weight)  # peft starts B at 0
    assert quantize_base(model, "nf4") == ["0", "2"]
    assert all(isinstance(model[i].base_layer, QuantLinear) for i in (0, 2))
    x = torch.randn(8, 100)
    y = model(x)
    y.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all((g is not None) == (".lora_" in n) for n, g in grads.items())
    plain = nn.Sequential(nn.Linear(100, 70), nn.GELU(), nn.Linear(70, 33))
    for i in (0, 2):
        m, q = model[i], model[i].base_layer
        plain[i].weight.data = q.dequantized() + m.scaling["default"] * (
            m.lora_B["default"].weight @ m.lora_A["default"].weight)
        plain[i].bias.data = q.bias.data.clone()
    torch.testing.assert_close(y, plain(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- bitsandbytes
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 1000, 7000])
def test_matches_bitsandbytes(n, dtype):
    """bitsandbytes' nf4 (CPU backend, blocksize 64): the same codes (its byte holds element 2j
    in the high nibble: swapped here), the same absmax, and its dequantize of pyfast's codes and
    scales equals pyfast's bit for bit."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    x = sample(n, dtype)
    packed, state = bnbf.quantize_4bit(x, quant_type="nf4", blocksize=64)
    codes, scales = quantize.quantize(x, "nf4", 64)
    theirs = packed.reshape(-1).to(torch.int64)
    theirs = torch.stack([theirs >> 4, theirs & 0xF], 1).reshape(-1)[:n]
    assert torch.equal(theirs, codes_of(codes, n))
    assert torch.equal(state.absmax.float(), scales)
    swapped = ((codes & 0xF) << 4) | (codes >> 4)
    y = bnbf.dequantize_4bit(swapped.view(-1, 1), state, quant_type="nf4", blocksize=64)
    assert torch.equal(y.reshape(-1), quantize.dequantize(codes, scales, n, "nf4", 64, dtype))
    assert torch.equal(torch.tensor(quantize.NF4_CODEBOOK), state.code.float().cpu())


def test_codes_match_torchao():
    """torchao's NF4Tensor (torchtune's QLoRA) uses the codebook rounded to 4 digits and always
    quantizes its scales to int8 (double quantization), so only its codes are comparable: they
    are pyfast's wherever y = x / absmax is more than 1e-4 from a midpoint (its rounded entries
    move the midpoints by < 5e-5). Its byte holds element 2j in the high nibble."""
    nf4t = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    x = torch.randn(64, 256)  # torchao needs whole blocks and whole scaler blocks
    n = x.numel()
    t = nf4t.to_nf4(x, 64, 256)
    qd = t.quantized_data.reshape(-1).to(torch.int64)
    theirs = torch.stack([qd >> 4, qd & 0xF], 1).reshape(-1)
    codes, scales = quantize.quantize(x, "nf4", 64)
    y = x.reshape(-1) / scales.repeat_interleave(64)
    near = ((y[:, None] - torch.tensor(quantize.NF4_THRESHOLDS)).abs() < 1e-4).any(1)
    assert torch.equal(theirs[~near], codes_of(codes, n)[~near])


def test_benchmark_runs():
    from pyfast.benchmarks import nf4_ops
    r = nf4_ops.run(numel=4096 + 7, repeats=1)
    assert r["nf4_vs_bf16"] >= 3.5 and len(r["rows"]) == 9
    assert "bytes a parameter" in nf4_ops.table(r)
