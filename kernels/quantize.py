"""Triton blockwise quantize / dequantize / dequantize-accumulate (docs/FORMATS.md, bit-exact).

Layout: a program owns TILE elements seen as a (R, C // P, P) tile, where a row is one quant
block (B <= TILE: C = B, R = TILE // B blocks per program) or a C = TILE chunk of one
(B > TILE: R = 1, the program loops over the block's B // TILE chunks). P is the number of
elements per code byte (int8/fp8 1, int4/nf4 2, sign 8), so a byte is a sum over the last axis
of `field << (bits * j)` and every load and store is over contiguous addresses.

nf4 reads a 31-float table (`_nf4_table`: the codebook, then the encoder's thresholds,
kernels/formats.py): a code is 15 compares with scalar loads, a value one gathered load.

Bit-exactness: launched with enable_fp_fusion=False (no FMA in (x * inv + M) - M or out + v * s),
divisions are div_rn (`/` is div.full.f32 on NVIDIA), e4m3fn and bfloat16 conversions are integer
bit arithmetic (the interpreter's fp8 and bf16 casts do not round to nearest even).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyfast.kernels.formats import FORMATS, NF4_CODEBOOK, NF4_THRESHOLDS, codes_len, scales_len

TILE = 4096  # elements per program: 16 per thread at 8 warps; 245 programs per 1M elements
NUM_WARPS = 8
FP8_MAX = tl.constexpr(FORMATS["fp8"].qmax)
OUT_ID = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# quantize_ref's `qmax / amax` (float / tensor) is torch's `amax.reciprocal() * qmax`: two
# roundings, not FORMATS.md's one division. The tests compare with it bitwise, so follow it;
# False gives the single correctly rounded division, once reference and spec agree.
INV_AS_RECIPROCAL = True


_NF4_TABLES: dict = {}


def _nf4_table(device) -> torch.Tensor:
    """fp32[31] on device: NF4_CODEBOOK (16), then NF4_THRESHOLDS (15); one per device."""
    t = _NF4_TABLES.get(device)
    if t is None:
        t = torch.tensor(NF4_CODEBOOK + NF4_THRESHOLDS, dtype=torch.float32, device=device)
        _NF4_TABLES[device] = t
    return t


# --------------------------------------------------------------------------- shared helpers
@triton.jit
def _rne(y):
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _bf16_to_f32(b):
    return (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(v):
    u = v.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(v != v, (u >> 16) | 0x40, r)  # NaN stays a (quiet) NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _load_f32(ptrs, mask, IN_BF16: tl.constexpr):
    if IN_BF16:
        return _bf16_to_f32(tl.load(ptrs, mask=mask, other=0))
    else:
        return tl.load(ptrs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _e4m3_encode(m):
    """Nearest-even e4m3fn code (int32, 0..0x7E) of fp32 magnitudes m in [0, 448]."""
    sub = _rne(m * 512.0).to(tl.int32)
    u = m.to(tl.int32, bitcast=True)
    u = u + 0x7FFFF + ((u >> 20) & 1)
    return tl.where(m < 0.015625, sub, tl.minimum((u >> 20) - 960, 0x7E))


@triton.jit
def _e4m3_decode(c):
    """fp32 magnitude of e4m3fn magnitude codes c (int32, 0..0x7F)."""
    normal = ((c + 960) << 20).to(tl.float32, bitcast=True)
    return tl.where(c < 8, (c & 7).to(tl.float32) * 0.001953125, normal)


@triton.jit
def _uniform(idx, seed_k):
    """u = (lowbias32((uint32)idx + seed * 0x9E3779B9) >> 8) * 2^-24; seed_k = that product."""
    k = idx.to(tl.uint32) + seed_k.to(tl.uint32, bitcast=True)
    k = k ^ (k >> 16)
    k = k * 0x7FEB352D
    k = k ^ (k >> 15)
    k = k * 0x846CA68B
    k = k ^ (k >> 16)
    return (k >> 8).to(tl.float32) * 5.9604644775390625e-08


# --------------------------------------------------------------------------- quantize
@triton.jit
def _amax(x):
    a = tl.abs(x)
    a = tl.where(a == a, a, float("inf"))  # NaN counts as non-finite, whatever max does
    return tl.max(tl.max(a, axis=2), axis=1)


@triton.jit
def _scale_inv(amax, QMAX: tl.constexpr, INV_RECIP: tl.constexpr):
    ok = amax < float("inf")
    pos = ok & (amax > 0.0)
    safe = tl.where(pos, amax, 1.0)
    if INV_RECIP:
        inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), safe) * QMAX
    else:
        inv = tl.math.div_rn(tl.full(amax.shape, QMAX, tl.float32), safe)
    scale = tl.where(ok, tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), float("nan"))
    return scale, tl.where(pos, inv, 0.0)[:, None, None], ok[:, None, None]


@triton.jit
def _encode(x, inv, ok, idx, n, seed_k, tab_ptr, KIND: tl.constexpr, QMAX: tl.constexpr,
            P: tl.constexpr, STOCH: tl.constexpr):
    """Code bytes (R, C // P) of an fp32 tile x (R, C // P, P) with element indices idx."""
    # inv is 0 in a non-finite block (every code 0). For amax < ~qmax / FLT_MAX inv is inf, and
    # 0 must still give 0, not 0 * inf = NaN (as the reference and the C++ kernel do)
    x = tl.where(ok, x, 0.0)
    y = tl.where(x != 0.0, x * inv, 0.0)
    if STOCH:
        u = _uniform(idx, seed_k)
    if KIND == 4:  # nf4: #{k : y > t_k}; a non-finite block and the pad nibble code 0
        c = tl.zeros(y.shape, tl.int32)
        for k in tl.static_range(15):
            c += (y > tl.load(tab_ptr + 16 + k)).to(tl.int32)
        field = tl.where(ok & (idx < n), c, 0)
    elif KIND == 2:  # fp8
        mag = tl.minimum(tl.abs(y), FP8_MAX)
        c = _e4m3_encode(mag)
        if STOCH:
            a = _e4m3_decode(c)
            other = tl.where(a < mag, c + 1, tl.maximum(c - 1, 0))
            b = _e4m3_decode(other)
            p = tl.math.div_rn(mag - a, tl.where(b != a, b - a, 1.0))
            c = tl.where(u < tl.where(b != a, p, 0.0), other, c)
        c = c | tl.where(y < 0.0, 0x80, 0)
        field = tl.where(c == 0x80, 0, c)
    else:
        q = tl.floor(y + u) if STOCH else _rne(y)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int32)
        field = q & ((1 << (8 // P)) - 1)
    shift = (tl.arange(0, P) * (8 // P))[None, None, :]
    return tl.sum(field << shift, axis=2).to(tl.uint8)


@triton.jit(do_not_specialize=["seed_k"])  # seed_k == 1 would otherwise become a constexpr
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, tab_ptr, n, nb, n_codes, seed_k,
                     KIND: tl.constexpr, QMAX: tl.constexpr, B: tl.constexpr, R: tl.constexpr,
                     C: tl.constexpr, P: tl.constexpr, STOCH: tl.constexpr,
                     IN_BF16: tl.constexpr, INV_RECIP: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)  # quant blocks of this program
    col = (tl.arange(0, C // P) * P)[None, :, None] + tl.arange(0, P)[None, None, :]
    bcol = tl.arange(0, C // P)[None, :]
    base = rows[:, None, None] * B
    bbase = rows[:, None] * (B // P)
    SEGS: tl.constexpr = B // C
    if KIND == 3:  # sign: bits need no scale; scale = mean |x| over the valid elements
        acc = tl.zeros([R], tl.float32)
        for s in range(SEGS):
            offs = base + s * C + col
            x = _load_f32(x_ptr + offs, offs < n, IN_BF16)
            acc += tl.sum(tl.sum(tl.abs(x), axis=2), axis=1)
            bits = (x < 0.0).to(tl.int32) << tl.arange(0, P)[None, None, :]
            boffs = bbase + s * (C // P) + bcol
            tl.store(codes_ptr + boffs, tl.sum(bits, axis=2).to(tl.uint8), mask=boffs < n_codes)
        cnt = tl.maximum(tl.minimum(n - rows * B, B), 1).to(tl.float32)
        mean = tl.math.div_rn(acc, cnt)
        mean = tl.where(tl.abs(mean) < float("inf"), mean, float("nan"))
        tl.store(scales_ptr + rows, mean, mask=rows < nb)
    elif SEGS == 1:  # whole blocks in registers: one read of x
        offs = base + col
        x = _load_f32(x_ptr + offs, offs < n, IN_BF16)
        scale, inv, ok = _scale_inv(_amax(x), QMAX, INV_RECIP)
        tl.store(scales_ptr + rows, scale, mask=rows < nb)
        byte = _encode(x, inv, ok, offs, n, seed_k, tab_ptr, KIND, QMAX, P, STOCH)
        tl.store(codes_ptr + bbase + bcol, byte, mask=bbase + bcol < n_codes)
    else:  # block larger than a tile: amax pass, then encode pass (second read mostly from L2)
        amax = tl.zeros([R], tl.float32)
        for s in range(SEGS):
            offs = base + s * C + col
            amax = tl.maximum(amax, _amax(_load_f32(x_ptr + offs, offs < n, IN_BF16)))
        scale, inv, ok = _scale_inv(amax, QMAX, INV_RECIP)
        tl.store(scales_ptr + rows, scale, mask=rows < nb)
        for s in range(SEGS):
            offs = base + s * C + col
            x = _load_f32(x_ptr + offs, offs < n, IN_BF16)
            byte = _encode(x, inv, ok, offs, n, seed_k, tab_ptr, KIND, QMAX, P, STOCH)
            boffs = bbase + s * (C // P) + bcol
            tl.store(codes_ptr + boffs, byte, mask=boffs < n_codes)


# --------------------------------------------------------------------------- dequantize
@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, tab_ptr, out_ptr, n, n_codes,
                       KIND: tl.constexpr, B: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                       P: tl.constexpr, ACC: tl.constexpr, OUT: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)  # C-element segments
    scale = tl.load(scales_ptr + seg // (B // C), mask=seg * C < n, other=1.0)[:, None, None]
    kk = tl.arange(0, C // P)
    boffs = seg[:, None] * (C // P) + kk[None, :]
    byte = tl.load(codes_ptr + boffs, mask=boffs < n_codes, other=0).to(tl.int32)
    j = tl.arange(0, P)[None, None, :]
    f = (byte[:, :, None] >> (j * (8 // P))) & ((1 << (8 // P)) - 1)
    if KIND == 0:
        v = ((f ^ 0x80) - 0x80).to(tl.float32)
    elif KIND == 1:
        v = ((f ^ 8) - 8).to(tl.float32)
    elif KIND == 2:
        mag = _e4m3_decode(f & 0x7F)
        v = tl.where(f >= 0x80, -mag, mag)
    elif KIND == 4:
        v = tl.load(tab_ptr + f)  # the NF4 codebook entry
    else:
        v = 1.0 - 2.0 * f.to(tl.float32)
    val = v * scale
    offs = seg[:, None, None] * C + (kk * P)[None, :, None] + j
    mask = offs < n
    if ACC:  # one fp32 add of the decoded product: out + fp32(v * s)
        tl.store(out_ptr + offs, tl.load(out_ptr + offs, mask=mask, other=0.0) + val, mask=mask)
    elif OUT == 2:
        tl.store(out_ptr + offs, _f32_to_bf16(val), mask=mask)
    else:
        tl.store(out_ptr + offs, val.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers
def _tile(block: int) -> tuple[int, int]:
    return TILE // min(block, TILE), min(block, TILE)  # (R, C)


def quantize(x: torch.Tensor, kind: str, block: int, stochastic: bool = False,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.reshape(-1).contiguous()
    n = x.numel()
    nb = scales_len(n, block)
    fmt = FORMATS[kind]
    codes = torch.empty(codes_len(n, kind), dtype=torch.uint8, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n == 0:
        return codes, scales
    r, c = _tile(block)
    seed_k = ((seed & 0xFFFFFFFF) * 0x9E3779B9) & 0xFFFFFFFF
    seed_k -= (seed_k >> 31) << 32  # as int32: bitcast back to uint32 in the kernel
    _quantize_kernel[(triton.cdiv(nb, r),)](
        x, codes, scales, _nf4_table(x.device), n, nb, codes.numel(), seed_k,
        KIND=fmt.id, QMAX=fmt.qmax or 1.0, B=block, R=r, C=c, P=fmt.per_byte,
        STOCH=bool(stochastic), IN_BF16=x.dtype == torch.bfloat16,
        INV_RECIP=INV_AS_RECIPROCAL, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return codes, scales


def _dequantize_into(out, codes, scales, n, kind, block, acc):
    r, c = _tile(block)
    fmt = FORMATS[kind]
    if n:
        _dequantize_kernel[(triton.cdiv(-(-n // c), r),)](
            codes.contiguous(), scales.contiguous(), _nf4_table(codes.device), out, n,
            codes.numel(), KIND=fmt.id,
            B=block, R=r, C=c, P=fmt.per_byte, ACC=acc, OUT=OUT_ID[out.dtype],
            num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out


def dequantize(codes: torch.Tensor, scales: torch.Tensor, n: int, kind: str, block: int,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """out (a contiguous dtype[n], checked by the caller) or a new tensor, decoded."""
    if dtype not in OUT_ID:
        raise TypeError(f"dequantize writes float32, float16 or bfloat16, not {dtype}")
    if out is None:
        out = torch.empty(n, dtype=dtype, device=codes.device)
    return _dequantize_into(out, codes, scales, n, kind, block, False)


def dequantize_accumulate_(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           kind: str, block: int) -> torch.Tensor:
    """out += dequantize(codes, scales); out is a contiguous fp32 buffer (checked by the caller)."""
    _dequantize_into(out.view(-1), codes, scales, out.numel(), kind, block, True)
    return out
