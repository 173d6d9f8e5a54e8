"""int8 / int4 / fp8 / sign: blockwise-scaled codes from pyfast.ops.quantize."""
from __future__ import annotations

import torch

from pyfast.compress.base import (Compressor, Payload, StepCounter, check_float, check_out,
                                  derive_seed, fill, flat)
from pyfast.ops import quantize as Q


class Quantizer(Compressor):
    def __init__(self, kind: str, block: int = Q.DEFAULT_BLOCK, stochastic: bool = False,
                 seed: int = 0):
        if kind not in Q.KINDS:
            raise ValueError(f"unknown quantization kind {kind!r}; valid: {', '.join(Q.KINDS)}")
        if stochastic and kind == "sign":
            raise ValueError("sign has no stochastic rounding")
        self.kind, self.block, self.stochastic, self.seed = kind, block, stochastic, seed
        self.spec = kind
        self._steps = StepCounter()

    def compress(self, x, name=""):
        check_float(x, self.spec)
        seed = derive_seed(self.seed, name, self._steps.next(name)) if self.stochastic else 0
        codes, scales = Q.quantize(x, self.kind, self.block, self.stochastic, seed)
        # scales first: fp32 views of the wire buffer stay 4-byte aligned
        return Payload({"scales": scales, "codes": codes}, x.shape, x.dtype)

    def decompress(self, p, out=None):
        t = p.tensors
        if out is None:
            y = Q.dequantize(t["codes"], t["scales"], p.numel, self.kind, self.block, p.dtype)
            return y.view(p.shape)
        check_out(p, out)
        into = flat(out)
        if into is None:  # no flat view of out: decode, then copy
            return fill(out, self.decompress(p))
        Q.dequantize(t["codes"], t["scales"], p.numel, self.kind, self.block, p.dtype, out=into)
        return out

    def layout(self, numel):
        return [("scales", torch.float32, -(-numel // self.block)),
                ("codes", torch.uint8, Q.codes_len(numel, self.kind))]

    def decompress_accumulate_(self, p, out: torch.Tensor) -> torch.Tensor:
        """out (contiguous fp32, p's numel) += decompress(p), without a temporary."""
        t = p.tensors
        return Q.dequantize_accumulate_(out.view(-1), t["codes"], t["scales"], self.kind,
                                        self.block)

    def state_dict(self):
        return self._steps.state_dict() if self.stochastic else {}

    def load_state_dict(self, state):
        if self.stochastic:
            self._steps.load_state_dict(state)
        else:
            super().load_state_dict(state)
