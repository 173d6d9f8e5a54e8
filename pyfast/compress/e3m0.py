"""e3m0: a 4-bit float per element (sign + 3 exponent bits) and one fp32 scale per block, the
format of Streaming DiLoCo's outer gradients (pyfast.ops.e3m0 has the format and its bound).

Declares what the collectives need (base.Compressor): a fixed layout, so the dense algorithms
(allgather, two-phase) run it; blocks of `block` elements; lossy (error feedback wraps it);
deterministic; no native-engine kind (the engine's C++ does not know the format: DataParallel's
engine="auto" picks the Python path for it).
"""
from __future__ import annotations

import torch

from pyfast.compress.base import Compressor, Payload, check_float, check_out, fill
from pyfast.ops import e3m0


class E3M0(Compressor):
    algorithm = "dense"

    def __init__(self, block: int = e3m0.DEFAULT_BLOCK):
        e3m0.check_block(block)
        self.block, self.spec = block, "e3m0"

    def compress(self, x, name=""):
        check_float(x, self.spec)
        codes, scales = e3m0.encode(x, self.block)
        return Payload({"scales": scales, "codes": codes}, x.shape, x.dtype)  # scales: aligned

    def decompress(self, p, out=None):
        t = p.tensors
        y = e3m0.decode(t["codes"], t["scales"], p.numel, self.block, p.dtype)
        if out is not None:
            check_out(p, out)
        return fill(out, y.view(p.shape) if out is None else y)

    def layout(self, numel):
        return [("scales", torch.float32, -(-numel // self.block)),
                ("codes", torch.uint8, e3m0.codes_len(numel))]
