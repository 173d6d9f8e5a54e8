"""Gradient compressors. `get(spec)` parses a spec; the registry is a dict.

Specs: none, fp16, bf16, fp8, int8, int4, e3m0, sign, ternary, topk:R, randomk:R, powersgd:RANK.
"""
from __future__ import annotations

import torch

from pyfast.compress.base import Compressor, NonFiniteGradient, Payload
from pyfast.compress.block import BlockCodec
from pyfast.compress.cast import Cast, NoCompression
from pyfast.compress.feedback import ErrorFeedback, WithFeedback, wrap
from pyfast.compress.powersgd import PowerSGD
from pyfast.compress.quant import Quantizer
from pyfast.compress.sparse import RandomK, TopK

VALID = ("none, fp16, bf16, fp8, int8, int4, e3m0, sign, ternary, topk:R, randomk:R, "
         "powersgd:RANK (R a fraction in (0, 1], RANK an integer >= 1)")


def _ratio(arg: str) -> float:
    try:
        r = float(arg)
    except ValueError:
        r = float("nan")
    if not 0.0 < r <= 1.0:
        raise ValueError(f"ratio {arg!r} is not in (0, 1]")
    return r


def _rank(arg: str) -> int:
    if not arg.isdigit() or int(arg) < 1:
        raise ValueError(f"rank {arg!r} is not an integer >= 1")
    return int(arg)


# name -> (takes a parameter, factory(param, **options))
REGISTRY = {
    "none": (False, lambda _, **o: NoCompression(**o)),
    "fp16": (False, lambda _, **o: Cast(torch.float16, **o)),
    "bf16": (False, lambda _, **o: Cast(torch.bfloat16, **o)),
    "fp8": (False, lambda _, **o: Quantizer("fp8", **o)),
    "int8": (False, lambda _, **o: Quantizer("int8", **o)),
    "int4": (False, lambda _, **o: Quantizer("int4", **o)),
    "e3m0": (False, lambda _, block=None: BlockCodec("e3m0", block)),
    "sign": (False, lambda _, **o: Quantizer("sign", **o)),
    "ternary": (False, lambda _, block=None, seed=0: BlockCodec("ternary", block, seed)),
    "topk": (True, lambda a, **o: TopK(_ratio(a), **o)),
    "randomk": (True, lambda a, **o: RandomK(_ratio(a), **o)),
    "powersgd": (True, lambda a, **o: PowerSGD(_rank(a), **o)),
}


def get(spec: str | Compressor | None, **options) -> Compressor:
    """A compressor for `spec`; options go to its constructor (e.g. block=256,
    stochastic=True for the quantizers, warm_start=False for powersgd, seed=... )."""
    if spec is None:
        spec = "none"
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"compressor spec must be a string, got {type(spec).__name__}; valid: {VALID}")
    name, sep, arg = spec.strip().partition(":")
    entry = REGISTRY.get(name)
    if entry is None or entry[0] != bool(sep):
        raise ValueError(f"unknown compressor spec {spec!r}; valid: {VALID}")
    try:
        return entry[1](arg, **options)
    except ValueError as e:
        raise ValueError(f"bad compressor spec {spec!r}: {e}; valid: {VALID}") from None
    except TypeError as e:
        raise ValueError(f"bad options {options} for {spec!r}: {e}") from None


__all__ = ["get", "wrap", "NonFiniteGradient", "PowerSGD", "Compressor", "Payload",
           "ErrorFeedback", "WithFeedback", "REGISTRY", "VALID"]
