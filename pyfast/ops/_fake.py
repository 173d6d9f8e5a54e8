"""Fake (meta) implementations of the torch.ops.pyfast.* kernels, for torch.compile / export:
the Python side of the schemas in csrc/module.cpp and csrc/ternary.cpp, one per op.

Output shapes follow docs/FORMATS.md. topk_select's length is data-dependent (how many |r| >= t,
capped by `limit`), so it is an unbacked size in [0, limit]. torch.library.register_fake needs
the op defined, so pyfast.ops._backend.cpp_status() imports this module right after pyfast._C.
It imports nothing of pyfast.ops (only the format table below it, pyfast.kernels.formats): the
op modules import _backend, so an import of one of them from here would close a circle.
"""
from __future__ import annotations

import torch

from pyfast.kernels.formats import codes_len


@torch.library.register_fake("pyfast::quantize")
def _quantize(x, kind, block, stochastic, seed):
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


def _ternary_encode(x, block, seed):
    n = x.numel()
    return (x.new_empty(-(-n // 4), dtype=torch.uint8),  # four 2-bit codes a byte
            x.new_empty(-(-n // block), dtype=torch.float32))


def _ternary_decode(codes, scales, n, block, dtype):
    return codes.new_empty(n, dtype=dtype)


# a pyfast._C built before csrc/ternary.cpp lacks these ops (ops/ternary.py then says so)
if hasattr(torch.ops.pyfast, "ternary_encode"):
    torch.library.register_fake("pyfast::ternary_encode", _ternary_encode)
    torch.library.register_fake("pyfast::ternary_decode", _ternary_decode)


def _adamw_(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay,
            grad_scale_t, grad_scale):
    return None  # in place: the outputs are the inputs, whose shapes do not change


# likewise a pyfast._C built before csrc/adamw.cpp (ops/adamw.py then says so)
if hasattr(torch.ops.pyfast, "adamw_"):
    torch.library.register_fake("pyfast::adamw_", _adamw_)
