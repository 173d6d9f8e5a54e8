"""Fake (meta) implementations of the torch.ops.pyfast.* kernels, for torch.compile / export.

Output shapes follow docs/FORMATS.md. topk_select's length is data-dependent (how many |r| >= t,
capped by `limit`), so it is an unbacked size in [0, limit]. Imported by
pyfast.ops._backend.cpp_status() once pyfast._C has defined the ops; it imports nothing of
pyfast at module level (quantize imports _backend: no import circle).
"""
from __future__ import annotations

import torch


@torch.library.register_fake("pyfast::quantize")
def _quantize(x, kind, block, stochastic, seed):
    from pyfast.ops.quantize import codes_len  # called at trace time, after ops/ is imported
    n = x.numel()
    return (x.new_empty(codes_len(n, kind), dtype=torch.uint8),
            x.new_empty(-(-n // block), dtype=torch.float32))


@torch.library.register_fake("pyfast::dequantize")
def _dequantize(codes, scales, n, kind, block, dtype):
    return codes.new_empty(n, dtype=dtype)


@torch.library.register_fake("pyfast::dequantize_accumulate_")
def _dequantize_accumulate_(out, codes, scales, kind, block):
    return None


@torch.library.register_fake("pyfast::topk_count")
def _topk_count(x, ef, threshold):
    return x.new_empty(2, dtype=torch.int64)


@torch.library.register_fake("pyfast::topk_select")
def _topk_select(x, ef, threshold, limit):
    n = x.numel()
    cap = max(0, min(limit, n)) if isinstance(limit, int) and isinstance(n, int) else None
    m = torch.library.get_ctx().new_dynamic_size(max=cap)
    return x.new_empty(m), x.new_empty(m, dtype=torch.int32)
