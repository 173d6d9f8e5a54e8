"""Blockwise quantize / dequantize / dequantize-accumulate: int8, int4, fp8 (e4m3fn), sign, and
nf4 (QLoRA's NormalFloat4 codebook; frozen weights only, never a gradient compressor).

The exact format is docs/FORMATS.md; this file holds the torch reference (`*_ref`) and the
dispatching entry points. Kernels: kernels/quantize.py (Triton), csrc/quantize.cpp (C++).
"""
from __future__ import annotations

import torch

# the format table lives in the bottom layer (kernels/formats.py), re-exported here
from pyfast.kernels.formats import (FORMATS, MAX_BLOCK, MIN_BLOCK, NF4_CODEBOOK,  # noqa: F401
                                    NF4_THRESHOLDS, WEIGHT_ONLY, Format, codes_len,
                                    scales_len)
from pyfast.ops._backend import resolve

KINDS = {kind: f.qmax for kind, f in FORMATS.items()}  # kind -> qmax
# Default block: 512 elements. Measured on this 2-core machine, 16M-element heavy-tailed
# gradient (bench/results/block_size.txt): scales cost 0.8% of int8's wire and 1.6% of int4's
# at 512 against 3.1% / 6.3% at 128, for a relative error 30% higher (int8 0.0163 vs 0.0125;
# int4 0.256 vs 0.203); C++ quantize + dequantize time is flat from 128 up (24.6 vs 26.1 ms).
# On bandwidth-bound links the wire wins; error feedback absorbs the rest.
DEFAULT_BLOCK = 512
_MAGIC = 12582912.0  # 1.5 * 2**23: (y + M) - M rounds fp32 y to nearest-even for |y| < 2**22


def check_args(x: torch.Tensor, kind: str, block: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown quantization kind {kind!r}; valid: {', '.join(KINDS)}")
    if block < MIN_BLOCK or block > MAX_BLOCK or block & (block - 1):
        raise ValueError(f"block size must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], "
                         f"got {block}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize takes float32, bfloat16 or float16 tensors, got {x.dtype}")


def check_stochastic(kind: str, stochastic: bool) -> None:
    if stochastic and kind == "sign":
        raise ValueError("sign has no stochastic rounding: its codes are exact signs")
    if stochastic and kind == "nf4":
        raise ValueError("nf4 has no stochastic rounding: it quantizes a frozen weight once, "
                         "to the nearest codebook entry")


# --------------------------------------------------------------------------- hash + fp8 helpers
def uniform_ref(seed: int, start: int, n: int, device) -> torch.Tensor:
    """u_i = (h(seed, i) >> 8) * 2^-24 for i in [start, start + n): lowbias32, FORMATS.md."""
    m = 0xFFFFFFFF
    k = (torch.arange(start, start + n, device=device, dtype=torch.int64)
         + ((seed & m) * 0x9E3779B9 & m)) & m
    k = k ^ (k >> 16)
    k = (k * 0x7FEB352D) & m
    k = k ^ (k >> 15)
    k = (k * 0x846CA68B) & m
    k = k ^ (k >> 16)
    return (k >> 8).to(torch.float32) * (2.0 ** -24)


def rne(y: torch.Tensor) -> torch.Tensor:
    return (y + _MAGIC) - _MAGIC


def e4m3_encode_mag(m: torch.Tensor) -> torch.Tensor:
    """Nearest-even e4m3fn code (int32, 0..0x7E) of magnitudes m in [0, 448]."""
    sub = rne(m * 512.0).to(torch.int32)
    u = m.view(torch.int32)
    u = u + 0x7FFFF + ((u >> 20) & 1)
    normal = ((u >> 20) - (120 << 3)).clamp(max=0x7E)
    return torch.where(m < 2.0 ** -6, sub, normal)


def e4m3_decode_mag(c: torch.Tensor) -> torch.Tensor:
    """fp32 magnitude of e4m3fn codes (int32, sign bit ignored)."""
    e = (c >> 3) & 0xF
    f = (c & 7).to(torch.float32)
    normal = (8.0 + f) * torch.exp2((e - 10).to(torch.float32))
    return torch.where(e == 0, f * 2.0 ** -9, normal)


def nf4_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codebook fp32[16], thresholds fp32[15]) on device: kernels/formats.py's NF4 table."""
    return (torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device),
            torch.tensor(NF4_THRESHOLDS, dtype=torch.float32, device=device))


def fit_scales(scales: torch.Tensor, kind: str) -> torch.Tensor:
    """amax / qmax rounds up for some amax within an ulp or two of FLT_MAX, and the top code
    then decodes to qmax * scale = inf: a finite gradient would arrive as inf. Such a scale
    steps down one ulp (qmax * scale < amax then). Applied after every backend's kernel, so
    codes and scales stay bitwise equal across backends; found by tests/test_compress_props.py
    (int8 of x = 3.4028235e38 decoded to inf)."""
    if kind == "sign" or not scales.numel():
        return scales
    over = torch.isinf(scales * KINDS[kind]) & torch.isfinite(scales)
    return torch.where(over, scales.nextafter(torch.zeros_like(scales)), scales)


# --------------------------------------------------------------------------- reference
def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    xf = x.reshape(-1).to(torch.float32)
    n = xf.numel()
    nb = scales_len(n, block)
    pad = nb * block - n
    xb = torch.nn.functional.pad(xf, (0, pad)).view(nb, block)
    valid = (torch.arange(nb * block, device=x.device) < n).view(nb, block)
    return xb, valid, n


def absmax_scales(a: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-block max of the magnitudes `a` (flat fp32, zero-padded to whole blocks), NaN for a
    block holding a NaN/Inf; each element's scale): the scales of ternary and e3m0."""
    n, nb = a.numel(), -(-a.numel() // block)
    padded = a.new_zeros(nb * block)
    padded[:n] = a
    blocks = padded.view(nb, block)
    scales = torch.where(torch.isfinite(blocks).all(1), blocks.amax(1), float("nan"))
    return scales, scales.repeat_interleave(block)[:n]


def quantize_ref(x: torch.Tensor, kind: str, block: int = DEFAULT_BLOCK,
                 stochastic: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(x, kind, block)
    check_stochastic(kind, stochastic)
    xb, valid, n = _blocks(x, block)
    if kind == "sign":
        s = xb.abs().sum(1) / valid.sum(1).clamp(min=1).to(torch.float32)
        scales = torch.where(torch.isfinite(s), s, torch.full_like(s, float("nan")))
        bits = (xb.reshape(-1)[: n] < 0).to(torch.uint8)
        bits = torch.nn.functional.pad(bits, (0, (-n) % 8)).view(-1, 8)
        weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=x.device)
        return (bits * weights).sum(1, dtype=torch.uint8), scales
    qmax = KINDS[kind]
    amax = xb.abs().amax(1)  # propagates NaN
    finite = torch.isfinite(amax)
    # a tensor divisor: torch on CUDA turns `tensor / python_float` into a reciprocal multiply
    scales = torch.where(finite, amax / torch.full_like(amax, qmax), torch.full_like(amax, float("nan")))
    scales = fit_scales(scales, kind)
    # reciprocal then multiply (what `qmax / amax` does in torch): FORMATS.md, two roundings
    inv = torch.where(finite & (amax > 0), amax.reciprocal() * qmax, torch.zeros_like(amax))
    y = (xb * inv[:, None]).reshape(-1)[:n]
    y = torch.where(finite.repeat_interleave(block)[:n], y, torch.zeros_like(y))
    y = torch.where(y.isnan(), torch.zeros_like(y), y)  # 0 * inf when 1/amax overflows
    u = uniform_ref(seed, 0, n, x.device) if stochastic else None
    if kind == "nf4":
        # #{k : y > t_k}: the nearest codebook entry, ties to the smaller (FORMATS.md); a
        # non-finite block codes 0 throughout, as every other kind
        c = torch.bucketize(y, nf4_tables(x.device)[1], right=False).to(torch.int32)
        c = torch.where(finite.repeat_interleave(block)[:n], c, torch.zeros_like(c))
        nib = torch.nn.functional.pad(c, (0, n % 2)).view(-1, 2)
        return (nib[:, 0] | (nib[:, 1] << 4)).to(torch.uint8), scales
    if kind == "fp8":
        mag = y.abs().clamp(max=FORMATS["fp8"].qmax)
        c = e4m3_encode_mag(mag)
        if stochastic:
            a = e4m3_decode_mag(c)
            other = torch.where(a < mag, c + 1, (c - 1).clamp(min=0))
            b = e4m3_decode_mag(other)
            p = torch.where(b != a, (mag - a) / (b - a), torch.zeros_like(a))
            c = torch.where(u < p, other, c)
        c = c | torch.where(y < 0, 0x80, 0).to(torch.int32)
        c = torch.where(c == 0x80, 0, c)  # -0 encodes as +0: one code per value
        return c.to(torch.uint8), scales
    q = torch.floor(y + u) if stochastic else rne(y)
    q = q.clamp(-qmax, qmax).to(torch.int32)
    if kind == "int8":
        return q.to(torch.int8).view(torch.uint8), scales
    nib = torch.nn.functional.pad(q & 0xF, (0, n % 2)).view(-1, 2)
    return (nib[:, 0] | (nib[:, 1] << 4)).to(torch.uint8), scales


def blocks_finite(decoded: torch.Tensor, block: int) -> bool:
    """Whether a flat tensor made of decoded blocks (block-aligned from its element 0: every
    collective's pieces are, comm.collectives' `align`), or of their sums, is finite, read at
    one element a block: a block holding NaN/Inf gets a NaN scale (quantize_ref and the
    kernels alike) and decodes to NaN throughout, and NaN survives the sums. n / block reads
    where a full pass reads n (check_finite="skip", pyfast.comm.guard)."""
    if decoded.numel() == 0 or decoded.is_meta:  # a dry run's meta tensors hold no values:
        return True  # finite, as the dry run's step reads (pyfast.comm.dry.read) assume
    return bool(torch.isfinite(decoded[::block]).all()) and bool(torch.isfinite(decoded[-1]))


def decode_ref(codes: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    """fp32 code values (before scaling) of the first n elements."""
    if kind == "int8":
        return codes[:n].view(torch.int8).to(torch.float32)
    if kind in ("int4", "nf4"):
        c = codes.to(torch.int32)
        nib = torch.stack([c & 0xF, c >> 4], 1).reshape(-1)[:n]
        if kind == "nf4":
            return nf4_tables(codes.device)[0][nib]
        return torch.where(nib >= 8, nib - 16, nib).to(torch.float32)
    if kind == "fp8":
        c = codes[:n].to(torch.int32)
        mag = e4m3_decode_mag(c & 0x7F)
        return torch.where(c >= 0x80, -mag, mag)
    bits = (codes.to(torch.int32)[:, None] >> torch.arange(8, device=codes.device)) & 1
    return 1.0 - 2.0 * bits.reshape(-1)[:n].to(torch.float32)


def dequantize_ref(codes: torch.Tensor, scales: torch.Tensor, n: int, kind: str,
                   block: int = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    v = decode_ref(codes, n, kind)
    s = scales.repeat_interleave(block)[:n]
    return (v * s).to(dtype)


def dequantize_accumulate_ref_(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                               kind: str, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    return out.add_(dequantize_ref(codes, scales, out.numel(), kind, block))


# --------------------------------------------------------------------------- dispatch
def _check_codes(codes, scales, n, kind, block):
    if kind not in KINDS:
        raise ValueError(f"unknown quantization kind {kind!r}; valid: {', '.join(KINDS)}")
    for what, t, dtype, want in (("codes", codes, torch.uint8, codes_len(n, kind)),
                                 ("scales", scales, torch.float32, scales_len(n, block))):
        if t.dtype != dtype or t.numel() != want:  # a wrong dtype is a TypeError, a size not
            kind_of = TypeError if t.dtype != dtype else ValueError
            raise kind_of(f"{kind} {what} for {n} elements in blocks of {block} must be "
                          f"{str(dtype).removeprefix('torch.')}[{want}], got "
                          f"{t.dtype}[{t.numel()}]")


def quantize(x: torch.Tensor, kind: str, block: int = DEFAULT_BLOCK, stochastic: bool = False,
             seed: int = 0, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x (any shape, flattened) blockwise; returns (codes uint8, scales fp32)."""
    check_args(x, kind, block)
    check_stochastic(kind, stochastic)
    x = x.reshape(-1)
    b = resolve(x.device, backend)
    if b == "cpp":
        codes, scales = torch.ops.pyfast.quantize(x, kind, block, stochastic, seed)
    elif b == "triton":
        from pyfast.kernels import quantize as tk
        codes, scales = tk.quantize(x, kind, block, stochastic, seed)
    else:
        return quantize_ref(x, kind, block, stochastic, seed)
    return codes, fit_scales(scales, kind)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, n: int, kind: str,
               block: int = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32,
               backend: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The n decoded values (dtype). With `out` (contiguous, dtype, n elements, on the codes'
    device) they are written there and out is returned: no new tensor on cpp (fp32) and
    triton."""
    _check_codes(codes, scales, n, kind, block)
    if out is not None:
        if out.dtype != dtype or out.numel() != n or not out.is_contiguous() \
                or out.device != codes.device:
            raise (TypeError if out.dtype != dtype else ValueError)(f"dequantize: out must be contiguous {dtype}[{n}] on {codes.device}, "
                             f"got {'' if out.is_contiguous() else 'non-contiguous '}"
                             f"{out.dtype}[{out.numel()}] on {out.device}")
        out = out.view(-1)
    b = resolve(codes.device, backend)
    if b == "cpp":
        if out is None:
            return torch.ops.pyfast.dequantize(codes, scales, n, kind, block, dtype)
        if dtype == torch.float32:  # no out= op in pyfast._C; -0.0 + v == v bitwise, for any v
            torch.ops.pyfast.dequantize_accumulate_(out.fill_(-0.0), codes, scales, kind, block)
            return out
        return out.copy_(torch.ops.pyfast.dequantize(codes, scales, n, kind, block, dtype))
    if b == "triton":
        from pyfast.kernels import quantize as tk
        return tk.dequantize(codes, scales, n, kind, block, dtype, out=out)
    y = dequantize_ref(codes, scales, n, kind, block, dtype)
    return y if out is None else out.copy_(y)


def dequantize_accumulate_(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           kind: str, block: int = DEFAULT_BLOCK,
                           backend: str | None = None) -> torch.Tensor:
    """out += dequantize(codes, scales); out is a contiguous fp32 buffer."""
    if out.dtype != torch.float32:
        raise TypeError(f"accumulate buffer must be contiguous float32, got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError("accumulate buffer must be contiguous float32, got a non-contiguous one")
    _check_codes(codes, scales, out.numel(), kind, block)
    b = resolve(out.device, backend)
    if b == "cpp":
        torch.ops.pyfast.dequantize_accumulate_(out, codes, scales, kind, block)
        return out
    if b == "triton":
        from pyfast.kernels import quantize as tk
        tk.dequantize_accumulate_(out, codes, scales, kind, block)
        return out
    return dequantize_accumulate_ref_(out, codes, scales, kind, block)
