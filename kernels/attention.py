"""Triton flash attention for one (query block, key/value block) pair of context-parallel (ring)
attention: a forward that also returns the log-sum-exp of each query row, and a backward that
takes the (possibly GLOBAL, merged over all key/value blocks) output and log-sum-exp.

What the kernels compute, for q [B, H, Sq, D], k and v [B, H, Sk, D]:
  s   = scale * q @ k^T                    fp32 accumulation
  s[i, j] = -inf where causal and j > i    top-left aligned, as torch SDPA's is_causal
  lse = logsumexp(s, -1)                   natural log, float32 [B, H, Sq]
  out = softmax(s) @ v                     q's dtype
Backward, given dout, out and lse (not recomputed: in ring attention every key/value block is
differentiated with the final merged out and lse, exactly as aten's CPU
_scaled_dot_product_flash_attention_for_cpu_backward treats its inputs):
  P   = exp(s - lse[..., None])            masked entries 0
  Dlt = rowsum(dout * out)                 fp32
  dv  = P^T @ dout,  dp = dout @ v^T,  ds = P * (dp - Dlt[..., None])
  dq  = scale * ds @ k,  dk = scale * ds^T @ q

Algorithm: FlashAttention-2 (Tri Dao 2023; Triton's fused-attention tutorial).
  forward  `_fwd_kernel`, grid (query blocks, B*H): a program keeps its [BLOCK_M, D] q tile and
           walks the key blocks with an online softmax (running row max m and row sum l in fp32,
           exp2 with scale*log2(e) folded into the scores), rescaling the fp32 accumulator by
           exp2(m_old - m_new) at each block; lse = (m + log2 l) * ln 2. Causal: key blocks past
           the program's last query row are not visited.
  backward three kernels, no atomics, so results are deterministic (run to run, and
           independent of the launch order):
           `_bwd_preprocess_kernel` Dlt = rowsum(dout * out) per query row;
           `_bwd_dkdv_kernel`, grid (key blocks, B*H): a program keeps its k, v tiles and loops
           over the query blocks (causal: from the first block that sees its keys) recomputing
           P^T from q and the given lse, accumulating dv and dk;
           `_bwd_dq_kernel`, grid (query blocks, B*H): keeps q, dout, lse, Dlt and loops over
           the key blocks accumulating dq.
  P and ds are rounded to the inputs' dtype before their tl.dot (tensor cores take bf16/fp16
  operands, as in FlashAttention); the interpreter mirrors that rounding (see below), so the
  tests see the numerics a GPU would have, not better ones.

Ragged shapes: Sq, Sk need not be multiples of the blocks and D need not be a power of two:
tl.arange spans BLOCK_D = next power of two >= max(D, 16) and every load and store is masked
(rows >= Sq, keys >= Sk, columns >= D); masked scores are -inf before the exp, padded rows
are never stored. A row with no visible key (impossible for top-left causal with Sk >= 1)
would get out = 0 and lse = -inf, not NaN: the running max is replaced by 0 while it is -inf.

Layouts: tensors are addressed through their strides (all four dims, passed to the kernels),
so views such as a [B, S, H, D] tensor transposed to [B, H, S, D] cost no copy, and the last
dim need not be contiguous (such loads are slower, not wrong). out, dq, dk, dv are new
contiguous tensors; lse (in) is made contiguous float32 ([B, H, Sq] is small).

Block sizes: on CUDA BLOCK_M = BLOCK_N = 64, num_warps 4, num_stages 2 (the tutorial's range),
and 32 where a padded row of q/k/v exceeds 256 bytes (fp32 with D > 64, bf16/fp16 with
D > 128). Shared memory per program, as triton.compile reports for sm_80 here (compiled to
cubin, never run): at 64, bf16 D=128 41/74/57 KB (fwd/dkdv/dq), fp32 D=64 66/82/82 KB, but
fp32 D=128 115/148/147 KB, over the 99 KB of sm_86/sm_89 and near the 163 KB of sm_80; at 32
fp32 D=128 53/70/70 KB, bf16 D=256 35/74/57 KB. Not tuned, not timed: no GPU here.
In Triton's interpreter (TRITON_INTERPRET=1, CPU tests) BLOCK_M = BLOCK_N = 16, tl.dot's
smallest tile, so the small test shapes (Sq, Sk 16..50) span several blocks on each axis with a
ragged last one; interpreter time grows with the number of blocks (roughly 0.05-0.3 s per
launch at the test sizes on this 2-core machine), so the tests stay small.
INTERPRET_CONFIG may be changed (tests use BLOCK_M != BLOCK_N once).

Interpreter workarounds (triton 3.9), as in kernels/matmul.py, only where the interpreter runs:
tl.dot on bfloat16 multiplies the raw uint16 storage as integers, so bf16/fp16 tiles are
upcast to fp32 before tl.dot (products of bf16/fp16 values are exact in fp32, as on tensor
cores); its fp32 -> bf16 cast truncates, so bf16 stores and the bf16 rounding of P and ds go
through quantize's round-to-nearest-even bit arithmetic (_f32_to_bf16). Launched with
enable_fp_fusion=False like the repo's other kernels (no FMA contraction; here that buys no
bit-exactness against torch, whose summation order differs, only consistency with the rest).

Executed only in Triton's interpreter: there is no GPU on the machine this was written on, so
the CUDA path (configs, tf32 choice, register/shared-memory fit) is unverified.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from .matmul import _store
from .quantize import _bf16_to_f32, _f32_to_bf16

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
LOG2E = 1.4426950408889634
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16}
CUDA_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
CUDA_CONFIG_WIDE = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
WIDE_ROW_BYTES = 256  # padded row bytes above which CUDA_CONFIG_WIDE (shared memory)


# --------------------------------------------------------------------------- helpers
@triton.jit
def _widen(x, INTERP: tl.constexpr):
    """A loaded tile as a tl.dot operand: fp32 in the interpreter (its bf16 dot is wrong)."""
    if INTERP:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _operand(x, KIND: tl.constexpr, INTERP: tl.constexpr):
    """An fp32 tile (P or ds) rounded to the inputs' dtype for tl.dot, as FlashAttention does;
    in the interpreter rounded (nearest even) and widened back to fp32."""
    if KIND == 0:
        return x
    elif KIND == 1:
        if INTERP:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x.to(tl.float16)
    else:
        if INTERP:
            return _bf16_to_f32(_f32_to_bf16(x))
        else:
            return x.to(tl.bfloat16)


@triton.jit
def _tile_ptrs(base, bh, H, s_b, s_h, s_s, s_d, rows, cols):
    """Pointers to the [rows, cols] tile of head bh (= b * H + h) of a [B, H, S, D] tensor."""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    return base + b * s_b + h * s_h + rows.to(tl.int64)[:, None] * s_s + cols[None, :] * s_d


# --------------------------------------------------------------------------- forward
@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                sob, soh, sos, sod,
                H, SQ, SK, D, qk_scale,
                CAUSAL: tl.constexpr, KIND: tl.constexpr, INTERP: tl.constexpr,
                RNE_BF16: tl.constexpr, PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = rows < SQ
    d_ok = offs_d < D
    q = tl.load(_tile_ptrs(Q, bh, H, sqb, sqh, sqs, sqd, rows, offs_d),
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q = _widen(q, INTERP)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = SK
    if CAUSAL:  # keys past this block's last row are masked for every row: skip them
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < SK
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(_tile_ptrs(K, bh, H, skb, skh, sks, skd, cols, offs_d), mask=kv_mask,
                    other=0.0)
        s = tl.dot(q, tl.trans(_widen(k, INTERP)), input_precision=PREC) * qk_scale
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf) = NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(_tile_ptrs(V, bh, H, svb, svh, svs, svd, cols, offs_d), mask=kv_mask,
                    other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(_operand(p, KIND, INTERP), _widen(v, INTERP), acc, input_precision=PREC)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no visible key: out 0, lse -inf
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    _store(_tile_ptrs(O, bh, H, sob, soh, sos, sod, rows, offs_d), out,
           m_ok[:, None] & d_ok[None, :], RNE_BF16)
    tl.store(LSE + bh.to(tl.int64) * SQ + rows, lse, mask=m_ok)


# --------------------------------------------------------------------------- backward
@triton.jit
def _bwd_preprocess_kernel(O, DO, DLT, sob, soh, sos, sod, sdb, sdh, sds, sdd, H, SQ, D,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = rows < SQ
    mask = m_ok[:, None] & (offs_d < D)[None, :]
    o = tl.load(_tile_ptrs(O, bh, H, sob, soh, sos, sod, rows, offs_d), mask=mask, other=0.0)
    do = tl.load(_tile_ptrs(DO, bh, H, sdb, sdh, sds, sdd, rows, offs_d), mask=mask, other=0.0)
    dlt = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DLT + bh.to(tl.int64) * SQ + rows, dlt, mask=m_ok)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DLT, DK, DV,
                     sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                     sdb, sdh, sds, sdd, skgb, skgh, skgs, skgd, svgb, svgh, svgs, svgd,
                     H, SQ, SK, D, scale, qk_scale,
                     CAUSAL: tl.constexpr, KIND: tl.constexpr, INTERP: tl.constexpr,
                     RNE_BF16: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = cols < SK
    d_ok = offs_d < D
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = _widen(tl.load(_tile_ptrs(K, bh, H, skb, skh, sks, skd, cols, offs_d), mask=kv_mask,
                       other=0.0), INTERP)
    v = _widen(tl.load(_tile_ptrs(V, bh, H, svb, svh, svs, svd, cols, offs_d), mask=kv_mask,
                       other=0.0), INTERP)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    row_base = bh.to(tl.int64) * SQ
    lo = 0
    if CAUSAL:  # query rows before this block's first key see none of its keys
        lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    for start_m in range(lo, SQ, BLOCK_M):
        rows = start_m + offs_m
        m_ok = rows < SQ
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = _widen(tl.load(_tile_ptrs(Q, bh, H, sqb, sqh, sqs, sqd, rows, offs_d), mask=q_mask,
                           other=0.0), INTERP)
        do = _widen(tl.load(_tile_ptrs(DO, bh, H, sdb, sdh, sds, sdd, rows, offs_d),
                            mask=q_mask, other=0.0), INTERP)
        lse2 = tl.load(LSE + row_base + rows, mask=m_ok, other=0.0) * 1.4426950408889634
        dlt = tl.load(DLT + row_base + rows, mask=m_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
        visible = n_ok[:, None] & m_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[:, None] <= rows[None, :])
        p_t = tl.exp2(tl.where(visible, s_t - lse2[None, :], float("-inf")))
        dv = tl.dot(_operand(p_t, KIND, INTERP), do, dv, input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - dlt[None, :])
        dk = tl.dot(_operand(ds_t, KIND, INTERP), q, dk, input_precision=PREC)
    _store(_tile_ptrs(DK, bh, H, skgb, skgh, skgs, skgd, cols, offs_d), dk * scale, kv_mask,
           RNE_BF16)
    _store(_tile_ptrs(DV, bh, H, svgb, svgh, svgs, svgd, cols, offs_d), dv, kv_mask, RNE_BF16)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DLT, DQ,
                   sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                   sdb, sdh, sds, sdd, sqgb, sqgh, sqgs, sqgd,
                   H, SQ, SK, D, scale, qk_scale,
                   CAUSAL: tl.constexpr, KIND: tl.constexpr, INTERP: tl.constexpr,
                   RNE_BF16: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = rows < SQ
    d_ok = offs_d < D
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = _widen(tl.load(_tile_ptrs(Q, bh, H, sqb, sqh, sqs, sqd, rows, offs_d), mask=q_mask,
                       other=0.0), INTERP)
    do = _widen(tl.load(_tile_ptrs(DO, bh, H, sdb, sdh, sds, sdd, rows, offs_d), mask=q_mask,
                        other=0.0), INTERP)
    row_base = bh.to(tl.int64) * SQ
    lse2 = tl.load(LSE + row_base + rows, mask=m_ok, other=0.0) * 1.4426950408889634
    dlt = tl.load(DLT + row_base + rows, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < SK
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _widen(tl.load(_tile_ptrs(K, bh, H, skb, skh, sks, skd, cols, offs_d), mask=kv_mask,
                           other=0.0), INTERP)
        v = _widen(tl.load(_tile_ptrs(V, bh, H, svb, svh, svs, svd, cols, offs_d), mask=kv_mask,
                           other=0.0), INTERP)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        visible = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        p = tl.exp2(tl.where(visible, s - lse2[:, None], float("-inf")))
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - dlt[:, None])
        dq = tl.dot(_operand(ds, KIND, INTERP), k, dq, input_precision=PREC)
    _store(_tile_ptrs(DQ, bh, H, sqgb, sqgh, sqgs, sqgd, rows, offs_d), dq * scale, q_mask,
           RNE_BF16)


# --------------------------------------------------------------------------- launchers
def _interpreted() -> bool:
    return bool(knobs.runtime.interpret)


def _check(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D [B, H, S, D] tensor, got "
                             f"{getattr(t, 'shape', type(t))}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise TypeError(f"q, k, v must share one dtype of {DTYPES}, got q {q.dtype} "
                        f"{tuple(q.shape)}, k {k.dtype} {tuple(k.shape)}, v {v.dtype} "
                        f"{tuple(v.shape)}")
    (b, h, _, d), (bk, hk, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    if (b, h, d) != (bk, hk, dk) or (bk, hk, sk, dk) != (bv, hv, sv, dv):
        raise ValueError(f"shapes must be q [B, H, Sq, D], k and v [B, H, Sk, D], got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")


def _config(d: int, dtype: torch.dtype) -> tuple[dict, dict, bool]:
    """(block sizes, launch options, interpreted) for head dim d and the inputs' dtype."""
    interp = _interpreted()
    block_d = max(16, triton.next_power_of_2(d))
    if interp:
        cfg = dict(INTERPRET_CONFIG)
        opts = {}
    else:
        wide = block_d * dtype.itemsize > WIDE_ROW_BYTES
        c = CUDA_CONFIG_WIDE if wide else CUDA_CONFIG
        cfg = {"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"]}
        opts = {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}
    cfg["BLOCK_D"] = block_d
    return cfg, opts, interp


def _flags(dtype: torch.dtype, interp: bool, causal: bool) -> dict:
    # torch's own fp32 matmul rounds operands to tf32 only when allowed: follow it (as matmul.py)
    prec = ("tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
            else "ieee")
    return dict(CAUSAL=bool(causal), KIND=KIND[dtype], INTERP=interp,
                RNE_BF16=interp and dtype == torch.bfloat16, PREC=prec, enable_fp_fusion=False)


def block_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Sq, D], k and v [B, H, Sk, D] of one dtype (float32, bfloat16, float16), any
    strides. Returns (out [B, H, Sq, D] in q's dtype, contiguous; lse [B, H, Sq] float32):
    s = scale * q @ k^T (fp32 accumulation), causal masks key j > query i (top-left aligned),
    lse = logsumexp(s, -1) (natural log), out = softmax(s) @ v."""
    _check(q, k, v)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    out = torch.empty(b, h, sq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if sk == 0:  # no keys: an empty softmax, out 0 and lse -inf (the kernel's value for it)
        return out.zero_(), lse.fill_(float("-inf"))
    cfg, opts, interp = _config(d, q.dtype)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    _fwd_kernel[grid](q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                      h, sq, sk, d, float(scale) * LOG2E,
                      **_flags(q.dtype, interp, causal), **cfg, **opts)
    return out, lse


def block_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of block_attention_fwd's block for upstream dout, given out
    [B, H, Sq, D] and lse [B, H, Sq], which may be the GLOBAL (merged over all key/value
    blocks) ones: they are used as given, not recomputed. P = exp(s - lse) (masked entries 0),
    Dlt = rowsum(dout * out), dv = P^T dout, ds = P * (dout v^T - Dlt), dq = scale ds k,
    dk = scale ds^T q; fp32 accumulation, results in the inputs' dtype, contiguous."""
    _check(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout and out must have q's shape {tuple(q.shape)}, got dout "
                         f"{tuple(dout.shape)}, out {tuple(out.shape)}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must be [B, H, Sq] = {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
    if dout.dtype not in DTYPES or out.dtype not in DTYPES:
        raise TypeError(f"dout {dout.dtype} and out {out.dtype} must be one of {DTYPES}")
    b, h, sq, d = q.shape
    sk = k.shape[2]
    dq = torch.zeros(b, h, sq, d, dtype=q.dtype, device=q.device)
    dk = torch.zeros(b, h, sk, d, dtype=k.dtype, device=k.device)
    dv = torch.zeros(b, h, sk, d, dtype=v.dtype, device=v.device)
    if b * h * d == 0 or sq == 0 or sk == 0:
        return dq, dk, dv
    lse = lse.to(torch.float32).contiguous()
    dlt = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    cfg, opts, interp = _config(d, q.dtype)
    bm, bn, bd = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_D"]
    _bwd_preprocess_kernel[(triton.cdiv(sq, bm), b * h)](
        out, dout, dlt, *out.stride(), *dout.stride(), h, sq, d, BLOCK_M=bm, BLOCK_D=bd,
        **opts)
    flags = _flags(q.dtype, interp, causal)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    _bwd_dkdv_kernel[(triton.cdiv(sk, bn), b * h)](
        q, k, v, dout, lse, dlt, dk, dv, *strides, *dk.stride(), *dv.stride(),
        h, sq, sk, d, float(scale), float(scale) * LOG2E, **flags, **cfg, **opts)
    _bwd_dq_kernel[(triton.cdiv(sq, bm), b * h)](
        q, k, v, dout, lse, dlt, dq, *strides, *dq.stride(),
        h, sq, sk, d, float(scale), float(scale) * LOG2E, **flags, **cfg, **opts)
    return dq, dk, dv


__all__ = ["block_attention_fwd", "block_attention_bwd"]
