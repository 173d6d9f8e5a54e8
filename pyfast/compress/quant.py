"""int8 / int4 / fp8 / sign: blockwise-scaled codes from pyfast.ops.quantize."""
from __future__ import annotations

import torch

from pyfast.compress.base import (Compressor, Payload, StepCounter, check_float, check_out,
                                  derive_seed, fill, flat)
from pyfast.ops import quantize


class Quantizer(Compressor):
    """Blockwise codes and one fp32 scale per block (docs/FORMATS.md).

    Bounds, per element x of a block with amax = max |x| over the block and step = amax / qmax
    (tests/test_compress_props.py checks exactly these):
    - int8 (qmax 127), int4 (qmax 7): |y - x| <= (1/2 + 2^-14) step + qmax 2^-128; a whole
      step instead of half with stochastic=True.
    - fp8 (e4m3, qmax 448): |y - x| <= (2^-4 + 2^-20) |x| + (2^-10 + 2^-14) step + 448 2^-128;
      2^-3 and 2^-9 instead of 2^-4 and 2^-10 with stochastic=True.
    - sign: |y| is the block's mean |x| (within 2^-14 relative: summation order), y < 0 iff
      x < 0; a block whose fp32 sum of |x| overflows (mean |x| >= 6.6e35 at block 512)
      decodes to NaN.
    Then half an ulp of x's dtype for bf16/fp16 tensors. The 2^-14 step covers the two
    roundings of 1 / amax * qmax (2^-22 relative where 1 / amax is subnormal); qmax 2^-128
    covers blocks with amax < qmax / FLT_MAX, whose non-zero elements all code to +-qmax.
    A block holding NaN or Inf decodes to NaN throughout: never to finite numbers.
    """
    algorithm = "dense"

    def __init__(self, kind: str, block: int = quantize.DEFAULT_BLOCK, stochastic: bool = False,
                 seed: int = 0):
        valid = [k for k in quantize.KINDS if k not in quantize.WEIGHT_ONLY]
        if kind in quantize.WEIGHT_ONLY:
            raise ValueError(f"{kind} is a format for frozen weights (a LoRA base: "
                             f"pyfast.models.quant_base), not a gradient compressor; "
                             f"valid: {', '.join(valid)}")
        if kind not in quantize.KINDS:
            raise ValueError(f"unknown quantization kind {kind!r}; valid: {', '.join(valid)}")
        if stochastic and kind == "sign":
            raise ValueError("sign has no stochastic rounding")
        self.kind, self.block, self.stochastic, self.seed = kind, block, stochastic, seed
        self.spec = kind
        self.deterministic = not stochastic
        self.native_kind = None if stochastic else kind  # stochastic seeds live in Python
        self._steps = StepCounter()

    def compress(self, x, name=""):
        check_float(x, self.spec)
        seed = derive_seed(self.seed, name, self._steps.next(name)) if self.stochastic else 0
        codes, scales = quantize.quantize(x, self.kind, self.block, self.stochastic, seed)
        # scales first: fp32 views of the wire buffer stay 4-byte aligned
        return Payload({"scales": scales, "codes": codes}, x.shape, x.dtype)

    def decompress(self, p, out=None):
        t = p.tensors
        if out is None:
            y = quantize.dequantize(t["codes"], t["scales"], p.numel, self.kind, self.block,
                                    p.dtype)
            return y.view(p.shape)
        check_out(p, out)
        into = flat(out)
        if into is None:  # no flat view of out: decode, then copy
            return fill(out, self.decompress(p))
        quantize.dequantize(t["codes"], t["scales"], p.numel, self.kind, self.block, p.dtype,
                            out=into)
        return out

    def layout(self, numel):
        return [("scales", torch.float32, -(-numel // self.block)),
                ("codes", torch.uint8, quantize.codes_len(numel, self.kind))]

    def decode_add(self, p, out: torch.Tensor) -> torch.Tensor:
        """out (contiguous fp32, p's numel) += decompress(p), without a temporary."""
        t = p.tensors
        return quantize.dequantize_accumulate_(out.view(-1), t["codes"], t["scales"], self.kind,
                                        self.block)

    def state_dict(self):
        return self._steps.state_dict() if self.stochastic else {}

    def load_state_dict(self, state):
        if self.stochastic:
            self._steps.load_state_dict(state)
        else:
            super().load_state_dict(state)
