"""none / fp16 / bf16: the plain and 16-bit baselines every other compressor must beat."""
from __future__ import annotations

import torch

from pyfast.compress.base import Compressor, Payload, aligned, check_float, check_out, fill


class NoCompression(Compressor):
    spec = "none"

    def compress(self, x, name=""):
        check_float(x, self.spec)
        return Payload({"data": x.reshape(-1)}, x.shape, x.dtype)

    def decompress(self, p, out=None):
        if out is not None:
            check_out(p, out)
        return fill(out, p.tensors["data"].view(p.shape))

    def compress_with_feedback(self, x, ef, name=""):
        return self.compress(x, name)  # nothing is lost, ef stays as it is

    def layout(self, numel):
        return None  # the wire dtype is the input's: see from_wire

    def from_wire(self, buf, shape, dtype, meta=None):
        buf = aligned(buf)
        return Payload({"data": buf.view(dtype)}, torch.Size(shape), dtype)


class Cast(Compressor):
    """Round to a 16-bit float. Values beyond fp16's range (65504) become Inf, as with torch's
    fp16_compress_hook; bf16 has fp32's range."""

    def __init__(self, wire: torch.dtype):
        self.wire = wire
        self.spec = {torch.float16: "fp16", torch.bfloat16: "bf16"}[wire]

    def compress(self, x, name=""):
        check_float(x, self.spec)
        return Payload({"data": x.reshape(-1).to(self.wire)}, x.shape, x.dtype)

    def decompress(self, p, out=None):
        if out is None:
            return p.tensors["data"].to(p.dtype).view(p.shape)
        check_out(p, out)
        return fill(out, p.tensors["data"])  # copy_ converts: one rounding, as .to() does

    def layout(self, numel):
        return [("data", self.wire, numel)]
