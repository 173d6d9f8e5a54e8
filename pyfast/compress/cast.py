"""none / fp16 / bf16: the plain and 16-bit baselines every other compressor must beat."""
from __future__ import annotations

import torch

from pyfast.compress.base import Compressor, Payload, aligned, check_float, check_out, fill


class NoCompression(Compressor):
    """Bound: exact, decompress(compress(x)) is x bit for bit (NaN and Inf included)."""
    spec = "none"
    algorithm, lossy, native_kind = "native", False, "none"

    def compress(self, x, name=""):
        check_float(x, self.spec)
        return Payload({"data": x.reshape(-1)}, x.shape, x.dtype)

    def decompress(self, p, out=None):
        if out is not None:
            check_out(p, out)
        return fill(out, p.tensors["data"].view(p.shape))

    def compress_with_feedback(self, x, ef, name="", out=None):
        if out is not None and out is not ef:
            out.copy_(ef)
        return self.compress(x, name)  # nothing is lost, ef stays as it is

    def layout(self, numel):
        return None  # the wire dtype is the input's: see from_wire

    def from_wire(self, buf, shape, dtype, meta=None):
        buf = aligned(buf)
        return Payload({"data": buf.view(dtype)}, torch.Size(shape), dtype)


class Cast(Compressor):
    """Round to a 16-bit float (nearest even).

    Bound (tests/test_compress_props.py checks exactly this): |y - x| <= 2^-11 |x| + 2^-25
    for fp16, <= 2^-8 |x| + 2^-134 for bf16 (half an ulp; half the smallest subnormal), plus
    half an ulp of x's dtype when the way back rounds again (bf16 through fp16). |x| >= 65520
    becomes +-Inf on fp16 (as with torch's fp16_compress_hook), |x| >= (2 - 2^-8) 2^127 on
    bf16. NaN and Inf pass unchanged."""
    algorithm, lossy = "dense", False

    def __init__(self, wire: torch.dtype):
        self.wire = wire
        self.spec = {torch.float16: "fp16", torch.bfloat16: "bf16"}[wire]
        self.native_kind = self.spec

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
