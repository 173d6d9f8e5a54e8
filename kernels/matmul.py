"""Triton matmul with a fused epilogue, act(a @ b + bias), for the sharded GEMMs (forward and
backward) of pyfast.ops.linear.linear_act.

A program owns a (BM, BN) tile of c, walks K in BK steps with tl.dot into an fp32 accumulator,
then adds the bias, optionally stores the pre-activation (the GELU backward needs it), applies
GELU and stores in the inputs' dtype. Loads are masked on every edge (ragged M, N, K) and
addressed through strides, so transposed views (W^T in the forward, dZ^T in the weight
gradient) cost no copy. Programs are ordered in GROUP_M-row groups so that consecutive programs
share tiles of b in L2 (the Triton matmul tutorial's swizzle).

Backward of y = gelu(z), z = x W^T + b, with x [M, K], W [N, K]:
  dz = dy * gelu'(z)   `gelu_grad`, a separate elementwise kernel (why: see there)
  dx = dz @ W          `matmul(dz, W)`
  dW = dz^T @ x        `matmul(dz.t(), x, rowsum=db)`: db = column sum of dz, fused (see there)

Config: on CUDA, triton.autotune over CONFIGS, keyed on (M, N, K) and the dtypes. In Triton's
interpreter (TRITON_INTERPRET=1, CPU tests) one fixed small config (INTERPRET_CONFIG): timing
the interpreter says nothing about a GPU, and each autotune trial would cost seconds.

Interpreter workarounds (triton 3.9), both exact, both only where the interpreter runs:
tl.dot on bfloat16 multiplies the raw uint16 storage as integers, so tiles are upcast to fp32
first (bf16 x bf16 products are exact in fp32, as on the tensor cores); and its fp32 -> bf16
cast truncates, so bf16 results go through quantize's round-to-nearest-even bit arithmetic.

Launched with enable_fp_fusion=False like the repo's other kernels. Here it does not buy
bit-exactness (the GEMM's summation order is not torch's; tests compare within a tolerance),
it only keeps the epilogue's mul/add from contracting into FMAs, a few ops per output element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from .quantize import _f32_to_bf16

ACT_ID = {None: 0, "gelu": 1, "gelu_tanh": 2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (BM, BN, BK, GROUP_M, num_stages, num_warps): the Triton tutorial's CUDA set trimmed to tiles
# whose fp32 operands fit in shared memory at these stage counts. Not tuned here: no GPU.
CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
    for bm, bn, bk, s, w in [(128, 256, 32, 3, 8), (256, 128, 32, 3, 8), (128, 128, 32, 4, 4),
                             (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4),
                             (128, 32, 32, 4, 4), (32, 64, 32, 5, 2)]]
# 16 is tl.dot's smallest tile: the test shapes (1..70) then span several tiles on every axis
INTERPRET_CONFIG = {"BM": 16, "BN": 16, "BK": 16, "GROUP_M": 2}
GRAD_BLOCK = 1024  # elements per program of gelu_grad: 4 per thread at 8 warps


# --------------------------------------------------------------------------- GELU
@triton.jit
def _sigmoid2u(z):
    """sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3): 0.5 (1 + tanh(u)) without cancellation."""
    u2 = 1.5957691216057308 * (z + 0.044715 * z * z * z)
    return 1.0 / (1.0 + tl.exp(tl.minimum(-u2, 80.0)))  # clamp: no exp overflow to inf


@triton.jit
def _act(z, ACT: tl.constexpr):
    if ACT == 1:  # torch's formula, erf(z / sqrt(2)): same cancellation for z << 0
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == 2:
        return z * _sigmoid2u(z)
    else:
        return z


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    if ACT == 1:  # Phi(z) + z phi(z)
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        return cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    else:  # s + z * 2 s (1 - s) du/dz, s = sigmoid(2u) = (1 + tanh u) / 2
        s = _sigmoid2u(z)
        return s + z * 2.0 * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)


@triton.jit
def _store(ptrs, v, mask, RNE_BF16: tl.constexpr):
    if RNE_BF16:
        tl.store(ptrs, _f32_to_bf16(v), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- matmul
@triton.jit
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, pre_ptr, rowsum_ptr, M, N, K,
                   s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SAVE_PRE: tl.constexpr,
                   ROWSUM: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
                   RNE_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + rn.to(tl.int64)[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    rsum = tl.zeros((BM,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        k_ok = rk < K - k * BK
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if ROWSUM:  # one add per a element, BN times fewer than the dot's
            rsum += tl.sum(a.to(tl.float32), axis=1)
        if INTERP:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs = rm.to(tl.int64)[:, None] * s_cm + rn.to(tl.int64)[None, :] * s_cn
    mask = m_ok[:, None] & n_ok[None, :]
    if SAVE_PRE:  # pre is allocated like c, so c's strides address it
        _store(pre_ptr + offs, acc, mask, RNE_BF16)
    _store(c_ptr + offs, _act(acc, ACT), mask, RNE_BF16)
    if ROWSUM:  # every program of a row block summed the same a rows: the first one stores
        if pid_n == 0:
            tl.store(rowsum_ptr + rm, rsum, mask=m_ok)


_matmul_tuned = triton.autotune(CONFIGS, key=["M", "N", "K"])(_matmul_kernel)


def _interpreted() -> bool:
    return bool(knobs.runtime.interpret)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, *, pre: torch.Tensor | None = None,
           rowsum: torch.Tensor | None = None) -> torch.Tensor:
    """act(a @ b + bias): a [M, K], b [K, N] and bias [N] of one dtype, any strides; fp32
    accumulation, a new contiguous [M, N] result in that dtype.

    pre: a contiguous [M, N] buffer of that dtype to receive a @ b + bias (before activation).
    rowsum: a float32 [M] buffer to receive a.sum(1), summed from the a tiles the GEMM loads
    anyway. In dW = dz^T @ x that is db = dz.sum(0) with no extra pass over dz (M x N, as
    large as the layer's output); a separate torch sum would read all of it once more.
    """
    (m, k), (k2, n) = a.shape, b.shape
    assert k == k2 and a.dtype == b.dtype in DTYPES, (a.shape, b.shape, a.dtype, b.dtype)
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if pre is not None:
        assert pre.shape == (m, n) and pre.is_contiguous() and pre.dtype == a.dtype
    if rowsum is not None:
        assert rowsum.shape == (m,) and rowsum.dtype == torch.float32 and rowsum.is_contiguous()
    if m == 0 or n == 0:
        if rowsum is not None:
            rowsum.copy_(a.sum(1, dtype=torch.float32))
        return c
    # torch's own fp32 matmul rounds operands to tf32 only when allowed: follow it
    prec = "tf32" if a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    interp = _interpreted()
    args = (a, b, bias if bias is not None else c, c, pre if pre is not None else c,
            rowsum if rowsum is not None else c, m, n, k, a.stride(0), a.stride(1),
            b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    flags = dict(HAS_BIAS=bias is not None, ACT=ACT_ID[activation], SAVE_PRE=pre is not None,
                 ROWSUM=rowsum is not None, PREC=prec, INTERP=interp,
                 RNE_BF16=interp and a.dtype == torch.bfloat16, enable_fp_fusion=False)
    if interp:
        cfg = INTERPRET_CONFIG
        grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
        _matmul_kernel[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
        _matmul_tuned[grid](*args, **flags)
    return c


# --------------------------------------------------------------------------- GELU backward
# dz = dy * gelu'(z) is its own elementwise pass rather than a prologue on the dx GEMM's loads
# of dy. dz feeds two GEMMs (dx = dz W loads it as a, dW = dz^T x as a^T) and db: written once,
# gelu' (an erf and an exp per element) is computed once, where a fused prologue recomputes it
# in each of the grid_n programs that load a tile, loads two tensors (dy, z) per tile instead
# of one, and the dW GEMM still needs dz in memory. The pass moves 3 x M x N elements against
# the two GEMMs' 4 x M x N x K flops; fusing could save at most one of those three passes
# (write dz from the dx GEMM's first column of programs). Unmeasured: no GPU on this machine.
@triton.jit
def _gelu_grad_kernel(dy_ptr, z_ptr, dz_ptr, n, ACT: tl.constexpr, RNE_BF16: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _store(dz_ptr + offs, dy * _act_grad(z, ACT), mask, RNE_BF16)


def gelu_grad(dy: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """dy * act'(z) for act "gelu" or "gelu_tanh"; dy and z of one shape and dtype."""
    assert activation in ("gelu", "gelu_tanh") and dy.shape == z.shape and dy.dtype == z.dtype
    dy, z = dy.contiguous(), z.contiguous()
    dz = torch.empty_like(dy)
    n = dz.numel()
    if n:
        _gelu_grad_kernel[(triton.cdiv(n, GRAD_BLOCK),)](
            dy, z, dz, n, ACT=ACT_ID[activation],
            RNE_BF16=_interpreted() and dz.dtype == torch.bfloat16, BLOCK=GRAD_BLOCK,
            num_warps=8, enable_fp_fusion=False)
    return dz
