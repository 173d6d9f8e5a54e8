"""Top-k by threshold with a fused error-feedback update (docs/FORMATS.md, "topk_*").

`topk(x, ratio, ef)` picks a threshold t (`threshold`: sampled, as in Deep Gradient
Compression, Lin et al. 2018), counts, moves t until the count is within [0.5k, 1.5k], then
selects; `threshold` alone lets a caller select part by part. The two passes
over the data (`topk_count`, `topk_select`) are kernels: kernels/topk.py (Triton),
csrc/topk.cpp (C++); `*_ref` here is the torch reference.
"""
from __future__ import annotations

import math
import os

import torch

from pyfast.errors import NonFiniteGradient
from pyfast.ops._backend import BackendUnavailable, resolve

# 16K sampled magnitudes: at R=0.01 the sample's k-th value lands the count within +-15% of k
# on Gaussian and heavy-tailed gradients (tests/test_ops_topk.py), and torch.topk on 16K
# values costs ~0.1 ms, noise next to one pass over a 16M-element gradient.
SAMPLE = 16384
MAX_REFINE = 6  # counting passes before the exact torch.topk threshold


def _check(x: torch.Tensor, ef: torch.Tensor | None) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"topk takes float32, bfloat16 or float16 tensors, got {x.dtype}")
    if x.numel() >= 2 ** 31:
        raise ValueError(f"topk indices are int32: {x.numel()} elements is too many")
    if ef is not None:
        if ef.dtype != torch.float32:
            raise TypeError(f"error-feedback buffer must be float32, got {ef.dtype}")
        if not ef.is_contiguous() or ef.numel() != x.numel():
            raise ValueError(f"error-feedback buffer must be contiguous float32[{x.numel()}], "
                             f"got {ef.dtype}[{ef.numel()}]")
        if ef.device != x.device:
            raise ValueError(f"error feedback on {ef.device} but input on {x.device}")


def _residual(x: torch.Tensor, ef: torch.Tensor | None) -> torch.Tensor:
    r = x.reshape(-1).to(torch.float32)
    return r + ef.reshape(-1) if ef is not None else r


def topk_count_ref(x: torch.Tensor, ef: torch.Tensor | None, t: float) -> torch.Tensor:
    r = _residual(x, ef)
    return torch.stack([(r.abs() >= t).sum(), (~torch.isfinite(r)).sum()]).to(torch.int64)


def topk_select_ref(x: torch.Tensor, ef: torch.Tensor | None, t: float,
                    limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    r = _residual(x, ef)
    idx = torch.nonzero(r.abs() >= t).reshape(-1)[:limit]
    values = r[idx].to(x.dtype)
    if ef is not None:
        ef.copy_(r.view_as(ef))
        ef.view(-1)[idx] = r[idx] - values.to(torch.float32)
    return values, idx.to(torch.int32)


def topk_count(x, ef, t, backend=None):
    _check(x, ef)
    x = x.reshape(-1)
    b = resolve(x.device, backend)
    if b == "cpp":
        return torch.ops.pyfast.topk_count(x, ef, float(t))
    if b == "triton":
        from pyfast.kernels import topk as tk
        return tk.topk_count(x, ef, float(t))
    return topk_count_ref(x, ef, t)


def topk_select(x, ef, t, limit, backend=None):
    _check(x, ef)
    x = x.reshape(-1)
    b = resolve(x.device, backend)
    if b == "cpp":
        return torch.ops.pyfast.topk_select(x, ef, float(t), int(limit))
    if b == "triton":
        from pyfast.kernels import topk as tk
        return tk.topk_select(x, ef, float(t), int(limit))
    return topk_select_ref(x, ef, t, limit)


def target(n: int, ratio: float) -> tuple[int, int, int]:
    """(k, lowest accepted count, highest accepted count) for a ratio of n elements."""
    k = min(n, max(1, round(ratio * n)))
    return k, max(1, math.ceil(0.5 * k)), max(1, math.floor(1.5 * k))


def _counts(x, ef, t, bounds, backend) -> list[int]:
    """#{|r| >= t} in each [a, b) of bounds. NaN/Inf anywhere raise NonFiniteGradient (before
    anything is written). One host read per call however many parts (each a CUDA sync else)."""
    every = torch.stack([topk_count(x[a:b], ef[a:b] if ef is not None else None, t, backend)
                         for a, b in bounds]).tolist()
    bad = sum(b for _, b in every)
    if bad:
        raise NonFiniteGradient(f"topk: input has {bad} NaN/Inf values (gradient overflow?); "
                                "refusing to hide them in the error-feedback memory")
    return [c for c, _ in every]


def threshold(x: torch.Tensor, ratio: float, ef: torch.Tensor | None = None,
              bounds: list[tuple[int, int]] | None = None,
              backend: str | None = None) -> tuple[float, list[int], int]:
    """(t, counts, limit) of topk's selection from the non-empty flat x (+ ef): the threshold,
    #{|r| >= t} in each part [a, b) of `bounds` (default: one part, all of x), and the most
    entries kept (ties at t past it are cut in index order). NaN/Inf raise NonFiniteGradient.
    A caller that selects part by part (topk_select on x[a:b] with t) gets exactly topk's
    selection: pyfast.comm.pipelined sends part i while part i+1 is selected."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"topk ratio must be in (0, 1], got {ratio}")
    _check(x, ef)  # whole: a part's view of a wrong-size ef would not show it
    x = x.reshape(-1)
    n = x.numel()
    if n == 0 or x.is_meta:
        raise ValueError(f"topk threshold: x must hold values, got {n} elements on {x.device}")
    bounds = bounds or [(0, n)]
    if [a for a, _ in bounds[1:]] != [b for _, b in bounds[:-1]] or bounds[0][0] != 0 \
            or bounds[-1][1] != n or any(b < a for a, b in bounds):
        raise ValueError(f"topk threshold: bounds must tile [0, {n}) in order, got {bounds}")
    k, lo, hi = target(n, ratio)
    stride = max(1, n // SAMPLE)
    sample = _residual(x[::stride], ef.view(-1)[::stride] if ef is not None else None).abs()
    ks = min(sample.numel(), max(1, round(ratio * sample.numel())))
    t = float(torch.topk(sample.nan_to_num(nan=math.inf), ks).values[-1])
    t_lo, t_hi = 0.0, math.inf  # count(t_lo) too high, count(t_hi) too low
    for _ in range(MAX_REFINE):
        counts = _counts(x, ef, t, bounds, backend)
        count = sum(counts)
        if lo <= count <= hi:
            return t, counts, hi
        if count > hi:
            t_lo = t
            t = t * 2.0 if t_hi == math.inf else 0.5 * (t + t_hi)
        else:
            t_hi = t
            t = 0.5 * (t_lo + t)
        if t == 0.0 or t == t_lo or t == t_hi:  # ties or all zeros: no t separates them
            break
    r = _residual(x, ef).abs()
    t = float(torch.topk(r, k).values[-1])  # exact: count(|r| >= t) >= k, ties capped by hi
    counts = torch.stack([(r[a:b] >= t).sum() for a, b in bounds]).tolist()
    return t, counts, hi


def topk_exact_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest |x|: (values in x.dtype, int32 indices ascending), ties at the k-th
    magnitude to the lower index (a stable sort), NaN above inf as in torch.topk."""
    x = x.reshape(-1)
    order = torch.sort(x.float().abs(), descending=True, stable=True).indices[:k]
    idx = order.sort().values
    return x[idx], idx.to(torch.int32)


def topk_exact(x: torch.Tensor, k: int, backend: str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly the k largest-magnitude entries of x (no error feedback): topk_exact_ref's
    result. On CUDA the Triton radix select (kernels/topk.py: two reads of x, where topk's
    threshold search takes a counting pass per refinement and a select pass); elsewhere the
    reference, which is the CPU path (there is no C++ kernel: asking for cpp raises)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"topk_exact takes float32, bfloat16 or float16 tensors, got {x.dtype}")
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"topk_exact: k must be in [0, {n}] for {n} elements, got {k}")
    if n >= 2 ** 31:
        raise ValueError(f"topk indices are int32: {n} elements is too many")
    b = resolve(x.device, backend)
    if b == "triton":
        from pyfast.kernels import topk as tk
        return tk.topk_exact(x, int(k))
    if b == "cpp" and (backend or os.environ.get("PYFAST_BACKEND") or "auto") != "auto":
        raise BackendUnavailable("backend 'cpp' was asked for but cannot run topk_exact: it "
                                 "has a Triton kernel (CUDA) and the torch reference only")
    return topk_exact_ref(x, k)


def topk(x: torch.Tensor, ratio: float, ef: torch.Tensor | None = None,
         backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """About ratio * n largest-magnitude entries of x (+ ef): (values in x.dtype, int32 indices).

    With `ef`, the residual x + ef is what is selected from, and ef keeps what was not sent.
    NaN/Inf in the residual raises pyfast.errors.NonFiniteGradient, a ValueError (it would
    otherwise sit in ef, never sent).
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"topk ratio must be in (0, 1], got {ratio}")
    _check(x, ef)
    x = x.reshape(-1)
    n = x.numel()
    if n == 0:
        return x.new_empty(0), torch.empty(0, dtype=torch.int32, device=x.device)
    if x.is_meta:  # a dry run: no values to search a threshold in; the largest selection the
        # search accepts sizes the payload (ef, updated in place, allocates nothing)
        hi = target(n, ratio)[2]
        return x.new_empty(hi), torch.empty(hi, dtype=torch.int32, device=x.device)
    t, _, hi = threshold(x, ratio, ef, None, backend)
    return topk_select(x, ef, t, hi, backend)
