"""Block codecs: a few bits per element and one fp32 scale per block of `block` elements, one
class for every such format, parameterized by the format's ops module (pyfast.ops.<format>:
encode, decode, codes_len, check_block, DEFAULT_BLOCK) and whether its encode draws:
- e3m0: a 4-bit float per element (sign + 3 exponent bits), the format of Streaming DiLoCo's
  outer gradients (pyfast.ops.e3m0 has the format and its bound); deterministic.
- ternary: TernGrad (Wen et al., NeurIPS 2017), 2 bits per element. y_i is 0 or sign(x_i) s
  with s = max |x| over x_i's block, so |y_i - x_i| <= s, and E[y_i] = x_i over the shared draw
  (stochastic rounding of |x_i| / s to {0, 1}). The draw comes from (seed, name, step), as the
  other stochastic compressors': every rank derives the same one.
A block holding NaN or Inf decodes to NaN throughout.

Declares what the collectives need (base.Compressor): a fixed layout (the scales, then the
codes), so the dense algorithms (allgather, two-phase) run it; blocks of `block` elements;
lossy (error feedback wraps it); no native-engine kind (the engine's C++ knows neither format:
DataParallel's engine="auto" picks the Python path for them).
"""
from __future__ import annotations

import torch

from pyfast.compress.base import (Compressor, Payload, StepCounter, check_float, check_out,
                                  derive_seed, fill)
from pyfast.ops import e3m0, ternary

# spec -> (its ops module, whether encode takes a seed: a stochastic format)
FORMATS = {"e3m0": (e3m0, False), "ternary": (ternary, True)}


class BlockCodec(Compressor):
    algorithm = "dense"

    def __init__(self, spec: str, block: int | None = None, seed: int | None = None):
        if spec not in FORMATS:
            raise ValueError(f"block codec {spec!r}: one of {', '.join(FORMATS)}")
        self.ops, stochastic = FORMATS[spec]
        if seed is not None and not stochastic:
            raise TypeError(f"{spec} draws nothing: it takes no seed")
        block = self.ops.DEFAULT_BLOCK if block is None else block
        self.ops.check_block(block)
        self.spec, self.block, self.deterministic = spec, block, not stochastic
        self.seed = (seed or 0) if stochastic else None
        self._steps = StepCounter() if stochastic else None

    def compress(self, x, name=""):
        check_float(x, self.spec)
        seed = () if self._steps is None else \
            (derive_seed(self.seed, name, self._steps.next(name)),)
        codes, scales = self.ops.encode(x, self.block, *seed)
        return Payload({"scales": scales, "codes": codes}, x.shape, x.dtype)  # scales: aligned

    def decompress(self, p, out=None):
        t = p.tensors
        y = self.ops.decode(t["codes"], t["scales"], p.numel, self.block, p.dtype)
        if out is not None:
            check_out(p, out)
        return fill(out, y.view(p.shape) if out is None else y)

    def layout(self, numel):
        return [("scales", torch.float32, -(-numel // self.block)),
                ("codes", torch.uint8, self.ops.codes_len(numel))]

    def state_dict(self):
        return {} if self._steps is None else self._steps.state_dict()

    def load_state_dict(self, state):
        if self._steps is None:
            return super().load_state_dict(state)
        self._steps.load_state_dict(state)
