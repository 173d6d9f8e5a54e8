"""ternary: TernGrad (Wen et al., NeurIPS 2017), 2 bits per element and one fp32 scale per block.

Declares what the collectives need (base.Compressor) and nothing else: a fixed layout, so the
dense algorithms (allgather, two-phase) run it, blocks of `block` elements, lossy (error
feedback wraps it), stochastic (no native-engine kind).

Bound: y_i is 0 or sign(x_i) s with s = max |x| over x_i's block, so |y_i - x_i| <= s, and
E[y_i] = x_i over the shared draw (stochastic rounding of |x_i| / s to {0, 1}). A block
holding NaN or Inf decodes to NaN throughout. The draw comes from (seed, name, step), as the
other stochastic compressors': every rank derives the same one.
"""
from __future__ import annotations

import torch

from pyfast.compress.base import (Compressor, Payload, StepCounter, check_float, check_out,
                                  derive_seed, fill)
from pyfast.ops import ternary


class Ternary(Compressor):
    algorithm, deterministic = "dense", False

    def __init__(self, block: int = ternary.DEFAULT_BLOCK, seed: int = 0):
        ternary.check_block(block)
        self.block, self.seed = block, seed
        self.spec = "ternary"
        self._steps = StepCounter()

    def compress(self, x, name=""):
        check_float(x, self.spec)
        seed = derive_seed(self.seed, name, self._steps.next(name))
        codes, scales = ternary.encode(x, self.block, seed)
        return Payload({"scales": scales, "codes": codes}, x.shape, x.dtype)  # scales: aligned

    def decompress(self, p, out=None):
        t = p.tensors
        y = ternary.decode(t["codes"], t["scales"], p.numel, self.block, p.dtype)
        if out is not None:
            check_out(p, out)
        return fill(out, y.view(p.shape) if out is None else y)

    def layout(self, numel):
        return [("scales", torch.float32, -(-numel // self.block)),
                ("codes", torch.uint8, ternary.codes_len(numel))]

    def state_dict(self):
        return self._steps.state_dict()

    def load_state_dict(self, state):
        self._steps.load_state_dict(state)
