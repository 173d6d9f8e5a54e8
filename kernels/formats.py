"""The quantization format table for Python and Triton: kinds, their kernel ids, qmax and
elements per code byte, block limits, wire sizes, NF4's codebook. csrc/format.h is the same
table for C++ and CUDA. Plain Python (no torch, no triton): the bottom layer, read by
kernels/quantize.py and by pyfast/ops/quantize.py above it."""
from __future__ import annotations

from typing import NamedTuple


class Format(NamedTuple):
    id: int             # the kernels' kind number (csrc/format.h's Quant)
    qmax: float | None  # largest code magnitude; sign has none (its scale is mean |x|); nf4's
                        # codebook spans [-1, 1], so its scale is amax itself
    per_byte: int       # elements per code byte


# The format table for Python and Triton (kernels/quantize.py); csrc/format.h is the same for
# C++ and CUDA. Wire image: fp32[scales_len] scales, then uint8[codes_len] codes.
FORMATS = {"int8": Format(0, 127.0, 1), "int4": Format(1, 7.0, 2), "fp8": Format(2, 448.0, 1),
           "sign": Format(3, None, 8), "nf4": Format(4, 1.0, 2)}
# Kinds for frozen weights only (a LoRA base, pyfast.models.quant_base), never a gradient
# compressor: compress.Quantizer refuses them, and they have no stochastic rounding.
WEIGHT_ONLY = frozenset({"nf4"})

# NF4 (QLoRA, Dettmers et al. 2023, arXiv:2305.14314, Appendix E; bitsandbytes'
# `get_4bit_type("nf4")` and its CUDA `nf4_dequantization_lut`): code c decodes to
# NF4_CODEBOOK[c] * scale. Every value is an exact float32 (these decimals are their shortest
# round-trip form).
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
# The encoder's thresholds: NF4_THRESHOLDS[k] is the largest float32 <= the exact midpoint of
# codebook entries k and k + 1, and the code of y is #{k : y > NF4_THRESHOLDS[k]}: the nearest
# entry, a tie (y exactly a midpoint) going to the smaller entry, as bitsandbytes' `>` tree.
# tests/test_nf4.py recomputes them with fractions.
NF4_THRESHOLDS = (
    -0.8480964303016663, -0.6106329560279846, -0.4599952697753906, -0.33967944979667664,
    -0.23460741341114044, -0.13791173696517944, -0.045525018125772476, 0.03979014977812767,
    0.120255246758461, 0.2035212516784668, 0.2920137643814087, 0.3893125355243683,
    0.5016633868217468, 0.6427869200706482, 0.8614783883094788)
MIN_BLOCK, MAX_BLOCK = 32, 65536  # block sizes: powers of two in this range


def codes_len(n: int, kind: str) -> int:
    return -(-n // FORMATS[kind].per_byte)


def scales_len(n: int, block: int) -> int:
    return -(-n // block)
