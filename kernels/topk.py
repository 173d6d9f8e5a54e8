"""Triton top-k by threshold with fused error feedback (docs/FORMATS.md, "topk_*", bit-exact).

topk_count: one pass, per-program partial counts summed by torch (deterministic, no atomics).
topk_select: ordered compaction in two passes. Pass 1 (the count kernel) gives each program's
number of |r| >= t; an exclusive torch.cumsum turns those into output offsets; pass 2 recomputes
r, places each selected element at offset + (its rank inside the program, tl.cumsum), keeps
only positions < limit, and rewrites ef in the same pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize import OUT_ID, _bf16_to_f32, _f32_to_bf16, _load_f32

# Elements per program: 8 per thread at 8 warps. ptxas (sm_80) gives the select kernel 64-70
# registers here (4 resident programs per SM) against 118-138 at 4096 (1-2 per SM).
BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _residual(x_ptr, ef_ptr, offs, mask, HAS_EF: tl.constexpr, IN_BF16: tl.constexpr):
    r = _load_f32(x_ptr + offs, mask, IN_BF16)
    if HAS_EF:
        r = r + tl.load(ef_ptr + offs, mask=mask, other=0.0)
    return r


@triton.jit
def _count_kernel(x_ptr, ef_ptr, part_ptr, n, t, HAS_EF: tl.constexpr, IN_BF16: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = _residual(x_ptr, ef_ptr, offs, mask, HAS_EF, IN_BF16)
    a = tl.abs(r)
    big = (a >= t) & mask
    bad = ((r != r) | (a == float("inf"))) & mask
    tl.store(part_ptr + 2 * pid, tl.sum(big.to(tl.int32), axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.sum(bad.to(tl.int32), axis=0))


@triton.jit
def _select_kernel(x_ptr, ef_ptr, start_ptr, val_ptr, idx_ptr, n, t, limit,
                   HAS_EF: tl.constexpr, IN_BF16: tl.constexpr, OUT: tl.constexpr,
                   BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = _residual(x_ptr, ef_ptr, offs, mask, HAS_EF, IN_BF16)
    sel = ((tl.abs(r) >= t) & mask).to(tl.int32)
    pos = tl.load(start_ptr + pid) + tl.cumsum(sel, axis=0) - sel  # exclusive rank
    keep = (sel != 0) & (pos < limit)
    if OUT == 0:
        v = r
        vf = r
    elif OUT == 1:
        v = r.to(tl.float16)
        vf = v.to(tl.float32)
    else:
        v = _f32_to_bf16(r)
        vf = _bf16_to_f32(v)
    tl.store(val_ptr + pos, v, mask=keep)
    tl.store(idx_ptr + pos, offs.to(tl.int32), mask=keep)
    if HAS_EF:
        tl.store(ef_ptr + offs, tl.where(keep, r - vf, r), mask=mask)


def _f32(t: float) -> float:
    """t rounded to fp32 (nearest even): torch compares an fp32 tensor with float t that way."""
    return float(torch.tensor(float(t), dtype=torch.float32, device="cpu"))  # a host scalar


def _counts(x, ef, t):
    n = x.numel()
    grid = triton.cdiv(n, BLOCK)
    part = torch.empty((grid, 2), dtype=torch.int32, device=x.device)
    _count_kernel[(grid,)](x, ef if ef is not None else x, part, n, _f32(t),
                           HAS_EF=ef is not None, IN_BF16=x.dtype == torch.bfloat16,
                           BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return part


def topk_count(x: torch.Tensor, ef: torch.Tensor | None, t: float) -> torch.Tensor:
    """int64[2]: [#{|r| >= t}, #{r not finite}] with r = fp32(x) + ef."""
    x = x.reshape(-1).contiguous()
    if x.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=x.device)
    return _counts(x, ef, t).sum(0, dtype=torch.int64)


def topk_select(x: torch.Tensor, ef: torch.Tensor | None, t: float,
                limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First min(limit, count) indices with |r| >= t in index order, values x.dtype(r);
    ef (if given) becomes r - fp32(value) where selected and r elsewhere."""
    x = x.reshape(-1).contiguous()
    n = x.numel()
    if n == 0:
        return x.new_empty(0), torch.empty(0, dtype=torch.int32, device=x.device)
    if n >= 2 ** 31:
        raise ValueError(f"topk indices are int32: {n} elements is too many")
    counts = _counts(x, ef, t)[:, 0]
    ends = torch.cumsum(counts, 0, dtype=torch.int32)  # total <= n < 2^31
    m = max(0, min(int(limit), int(ends[-1])))  # the one host sync: the output size
    # at least one element each: no null pointer is handed to the kernel when m == 0
    values = torch.empty(max(m, 1), dtype=x.dtype, device=x.device)[:m]
    indices = torch.empty(max(m, 1), dtype=torch.int32, device=x.device)[:m]
    if m == 0 and ef is None:
        return values, indices
    grid = counts.numel()
    _select_kernel[(grid,)](x, ef if ef is not None else x, ends - counts, values, indices, n,
                            _f32(t), m, HAS_EF=ef is not None,
                            IN_BF16=x.dtype == torch.bfloat16, OUT=OUT_ID[x.dtype],
                            BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return values, indices


# -- exact top-k by magnitude in two reads of the input (radix select, as AIR top-k and
# cub::DeviceTopK do it) ---------------------------------------------------------------------
# |x| as fp32 bits is a key whose unsigned order is the magnitude's (NaN above inf, as
# torch.topk). Pass 1 histograms each key's top bits; the host finds the bin holding the k-th
# largest; pass 2 writes out the indices of every key above that bin and gathers the bin's own
# candidates, from which torch picks the rest (a few thousand of 64M gradient-like values: 2048
# bins are an eighth of an octave each). Positions come from atomics, so pass 2's order is the
# hardware's; the result is sorted by index afterwards (k elements), ties at the k-th value
# broken toward the lower index: the same set as the reference whatever the order.
RADIX_SHIFT = 20             # 31-bit key >> 20: 11 bits, the exponent and 3 mantissa bits
RADIX_BINS = 1 << (31 - RADIX_SHIFT)
HIST_TILES = 16             # tiles of BLOCK a histogram program reads


@triton.jit
def _key(x_ptr, offs, mask):
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return v.to(tl.uint32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _hist_kernel(x_ptr, hist_ptr, n, SHIFT: tl.constexpr, BINS: tl.constexpr,
                 BLOCK: tl.constexpr, TILES: tl.constexpr):
    # TILES tiles a program, one atomic add of its histogram: one a tile would put 2048
    # atomics on the same 2048 words for every 2048 elements (64M: 67M contended atomics)
    start = tl.program_id(0).to(tl.int64) * BLOCK * TILES
    h = tl.zeros([BINS], tl.int32)
    for i in range(TILES):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        h += tl.histogram((_key(x_ptr, offs, mask) >> SHIFT).to(tl.int32), BINS, mask=mask)
    tl.atomic_add(hist_ptr + tl.arange(0, BINS), h, sem="relaxed")


@triton.jit
def _split_kernel(x_ptr, n, bstar, above_ptr, cand_ptr, count_ptr, SHIFT: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = (_key(x_ptr, offs, mask) >> SHIFT).to(tl.int32)
    hi = (mask & (b > bstar)).to(tl.int32)
    eq = (mask & (b == bstar)).to(tl.int32)
    base_hi = tl.atomic_add(count_ptr, tl.sum(hi, axis=0), sem="relaxed")
    base_eq = tl.atomic_add(count_ptr + 1, tl.sum(eq, axis=0), sem="relaxed")
    tl.store(above_ptr + base_hi + tl.cumsum(hi, axis=0) - hi, offs.to(tl.int32), mask=hi != 0)
    tl.store(cand_ptr + base_eq + tl.cumsum(eq, axis=0) - eq, offs.to(tl.int32), mask=eq != 0)


def topk_exact(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest |x| (values in x.dtype, int32 indices ascending); ties at the k-th
    magnitude go to the lower index."""
    x = x.reshape(-1).contiguous()
    n = x.numel()
    if k == 0 or n == 0:
        return x.new_empty(0), torch.empty(0, dtype=torch.int32, device=x.device)
    grid = triton.cdiv(n, BLOCK)
    hist = torch.zeros(RADIX_BINS, dtype=torch.int32, device=x.device)
    _hist_kernel[(triton.cdiv(n, BLOCK * HIST_TILES),)](
        x, hist, n, SHIFT=RADIX_SHIFT, BINS=RADIX_BINS, BLOCK=BLOCK, TILES=HIST_TILES,
        num_warps=NUM_WARPS)
    # from the top bin down: the first bin whose running count reaches k; one host read
    desc = torch.cumsum(hist.flip(0), 0)
    j = torch.searchsorted(desc, torch.tensor([k], dtype=desc.dtype, device=x.device))
    j, upto, n_cand = torch.cat([j, desc[j], hist.flip(0)[j]]).tolist()
    bstar, above = RADIX_BINS - 1 - j, upto - n_cand
    idx_above = torch.empty(max(above, 1), dtype=torch.int32, device=x.device)
    cand = torch.empty(max(n_cand, 1), dtype=torch.int32, device=x.device)
    counts = torch.zeros(2, dtype=torch.int32, device=x.device)
    _split_kernel[(grid,)](x, n, bstar, idx_above, cand, counts, SHIFT=RADIX_SHIFT,
                           BLOCK=BLOCK, num_warps=NUM_WARPS)
    cand = cand[:n_cand].sort().values  # index order, so the stable sort below breaks ties low
    mags = x[cand].float().abs()
    order = torch.sort(mags, descending=True, stable=True).indices[:k - above]
    idx = torch.cat([idx_above[:above], cand[order]]).sort().values
    return x[idx], idx
