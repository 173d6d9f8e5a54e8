"""block_attention(q, k, v, causal, scale) -> (out, lse): attention over one block of keys with
its log-sum-exp, and block_attention_backward(dout, q, k, v, out, lse, ...) -> (dq, dk, dv): the
pieces ring attention is made of (pyfast.parallel.context). The flash-attention recurrence
(Dao 2023) merges blocks exactly: with L = logaddexp(lse_a, lse_b),
out = exp(lse_a - L) out_a + exp(lse_b - L) out_b; and a block's gradients computed from the
MERGED out and lse are its exact share of the full attention's (the backward recomputes
P = exp(s - lse) and uses D = rowsum(dout * out)), so blocks never need each other's scores.

q [B, H, Sq, D], k and v [B, H, Sk, D]; s = scale * q k^T, causal masks key j > query i
(top-left, as torch's SDPA); lse [B, H, Sq] float32 (natural log); out in q's dtype.

Backends: "triton" (CUDA tensors, kernels/attention.py; CPU tensors only in Triton's
interpreter when forced, as the tests do), "cpp" (CPU tensors: aten's C++/OpenMP flash-attention
kernel, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu and its backward, which
return the log-sum-exp and accept an outside one), "torch" (the reference below: explicit
scores in fp32). Measured on the 2-core EPYC VM, 1 thread, fp32, B=1 H=4 D=64 causal: the aten
kernel runs 72-77 GFLOP/s forward and 65-75 backward at 4K-16K tokens; the reference
materialises [Sq, Sk] scores (4 GB at 16K tokens a head), so it is for tests only.
"""
from __future__ import annotations

import os

import torch

from pyfast.ops._backend import BackendUnavailable, status

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str = "block_attention") -> None:
    """ValueError/TypeError naming the shapes unless q [B,H,Sq,D], k/v [B,H,Sk,D] of one dtype."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{what}: q, k, v must be [B, H, S, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{what}: q, k, v must share one dtype of float32, bfloat16, float16; "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{what}: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} "
                         "must agree in batch, heads and head dim (k and v in every dim)")
    if len({q.device, k.device, v.device}) > 1:
        raise ValueError(f"{what}: q, k, v on different devices: {q.device}, {k.device}, {v.device}")


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else q.shape[-1] ** -0.5


# ---------------------------------------------------------------- the reference
def _mask(sq: int, sk: int, device) -> torch.Tensor:
    i = torch.arange(sq, device=device)[:, None]
    return torch.arange(sk, device=device)[None, :] <= i  # top-left: key j visible to query i


def _probs(q, k, lse, causal, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]), lse


def block_attention_ref(q, k, v, causal: bool = False, scale: float | None = None):
    check(q, k, v)
    p, lse = _probs(q, k, None, causal, default_scale(q, scale))
    return torch.matmul(p, v.float()).to(q.dtype), lse


def block_attention_backward_ref(dout, q, k, v, out, lse, causal: bool = False,
                                 scale: float | None = None):
    check(q, k, v)
    sc = default_scale(q, scale)
    p, _ = _probs(q, k, lse.float(), causal, sc)
    do = dout.float()
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, v.float().transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k.float()) * sc
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * sc
    dv = torch.matmul(p.transpose(-1, -2), do)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------- dispatch
def backend_for(device: torch.device, backend: str | None = None) -> str:
    """triton on CUDA, cpp (aten's flash kernel) on CPU and meta, torch elsewhere; a forced backend
    (argument or PYFAST_BACKEND) that cannot run raises BackendUnavailable. The cpp path needs
    no pyfast._C (its kernel is torch's), so it has its own check rather than ops.resolve's."""
    name = backend or os.environ.get("PYFAST_BACKEND") or "auto"
    if name == "auto":
        # meta (a dry run): aten's CPU flash kernels have meta kernels, and size their O(S)
        # outputs; the torch reference would materialize the S x S scores
        name = {"cuda": "triton", "cpu": "cpp", "meta": "cpp"}.get(device.type, "torch")
        if name == "triton" and not status("triton", device)[0]:
            raise BackendUnavailable(f"block_attention on CUDA needs Triton: "
                                     f"{status('triton', device)[1]}")
        return name
    if name == "cpp":
        if device.type not in ("cpu", "meta"):
            raise BackendUnavailable(f"backend 'cpp' was asked for but cannot run: attention's "
                                     f"C++ kernel is aten's CPU one (with a meta kernel), not "
                                     f"{device.type}")
        return name
    ok, why = status(name, device)
    if not ok:
        raise BackendUnavailable(f"backend {name!r} was asked for but cannot run: {why}")
    return name


def block_attention(q, k, v, causal: bool = False, scale: float | None = None,
                    backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] float32) of one block (see the module)."""
    check(q, k, v)
    sc, name = default_scale(q, scale), backend_for(q.device, backend)
    if name == "cpp":
        out, lse = _FWD(q, k, v, 0.0, causal, scale=sc)
        return out, lse
    if name == "triton":
        from pyfast.kernels import attention as tk
        return tk.block_attention_fwd(q, k, v, causal, sc)
    return block_attention_ref(q, k, v, causal, sc)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool = False,
                             scale: float | None = None, backend: str | None = None):
    """(dq, dk, dv) of one block given the upstream dout and the (merged) out and lse."""
    check(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"block_attention_backward: dout {tuple(dout.shape)}, out "
                         f"{tuple(out.shape)} must be q's {tuple(q.shape)} and lse "
                         f"{tuple(lse.shape)} [B, H, Sq]")
    sc, name = default_scale(q, scale), backend_for(q.device, backend)
    if name == "cpp":
        # aten reads dout/out as q's dtype and lse as fp32 ([B, H, Sq] contiguous rows)
        return _BWD(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.float().contiguous(), 0.0,
                    causal, scale=sc)
    if name == "triton":
        from pyfast.kernels import attention as tk
        return tk.block_attention_bwd(dout, q, k, v, out, lse, causal, sc)
    return block_attention_backward_ref(dout, q, k, v, out, lse, causal, sc)
