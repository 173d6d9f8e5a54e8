"""The quantization format table for Python and Triton: kinds, their kernel ids, qmax and
elements per code byte, block limits, wire sizes. csrc/format.h is the same table for C++ and
CUDA. Plain Python (no torch, no triton): the bottom layer, read by kernels/quantize.py and by
pyfast/ops/quantize.py above it."""
from __future__ import annotations

from typing import NamedTuple


class Format(NamedTuple):
    id: int             # the kernels' kind number (csrc/format.h's Quant)
    qmax: float | None  # largest code magnitude; sign has none (its scale is mean |x|)
    per_byte: int       # elements per code byte


# The format table for Python and Triton (kernels/quantize.py); csrc/format.h is the same for
# C++ and CUDA. Wire image: fp32[scales_len] scales, then uint8[codes_len] codes.
FORMATS = {"int8": Format(0, 127.0, 1), "int4": Format(1, 7.0, 2), "fp8": Format(2, 448.0, 1),
           "sign": Format(3, None, 8)}
MIN_BLOCK, MAX_BLOCK = 32, 65536  # block sizes: powers of two in this range


def codes_len(n: int, kind: str) -> int:
    return -(-n // FORMATS[kind].per_byte)


def scales_len(n: int, block: int) -> int:
    return -(-n // block)
