"""The compressor -> comm contract: the collectives choose from what a compressor declares
(base.Compressor's algorithm, block, per_tensor, lossy, native_kind, wire_bytes, decode_add,
base / feedback), never from its type."""
import pytest
import torch

import pyfast.compress as C
from pyfast.comm import engine as E
from pyfast.comm.collectives import choose
from pyfast.compress.base import Compressor, Payload

TABLE = {  # spec: (algorithm, per_tensor, lossy, native_kind, block)
    "none": ("native", False, False, "none", 1),
    "fp16": ("dense", False, False, "fp16", 1),
    "bf16": ("dense", False, False, "bf16", 1),
    "int8": ("dense", False, True, "int8", 512),
    "int4": ("dense", False, True, "int4", 512),
    "fp8": ("dense", False, True, "fp8", 512),
    "sign": ("dense", False, True, "sign", 512),
    "topk:0.1": ("sparse-allgather", True, True, None, 1),
    "randomk:0.1": ("shared-index", False, True, None, 1),
    "powersgd:2": ("powersgd", True, True, None, 1),
}


@pytest.mark.parametrize("spec", list(TABLE))
def test_declarations_and_feedback_delegates(spec):
    c = C.get(spec)
    got = (c.algorithm, c.per_tensor, c.lossy, c.native_kind, c.block)
    assert got == TABLE[spec]
    assert c.base is c and c.feedback is None
    w = C.wrap(c)
    if c.lossy:
        assert isinstance(w, C.WithFeedback) and w.base is c and w.feedback is not None
        assert (w.algorithm, w.per_tensor, w.lossy, w.native_kind, w.block) == got
    else:
        assert w is c
    assert C.wrap(c, error_feedback=False) is c
    assert C.get("int8", stochastic=True).native_kind is None  # seeds live in Python


class Halves(Compressor):
    """A compressor no comm file knows: fp16 on the wire, declared dense."""
    spec, algorithm, lossy = "halves", "dense", False

    def compress(self, x, name=""):
        return Payload({"data": x.reshape(-1).to(torch.float16)}, x.shape, x.dtype)

    def decompress(self, p, out=None):
        y = p.tensors["data"].to(p.dtype).view(p.shape)
        return y if out is None else out.copy_(y.reshape(out.shape))

    def layout(self, numel):
        return [("data", torch.float16, numel)]


def test_choose_reads_declarations():
    c = Halves()
    assert c.wire_bytes(1000) == 2000 and c.align == 8
    assert choose(c, 1000, 2) == "allgather" and choose(c, 10 ** 7, 4) == "two-phase"
    assert E._kind(c) is None  # no native_kind declared: only the Python path
    c.native_kind = "fp16"
    assert E.NativeEngine.supports(c)
    c.algorithm = "nonsense"
    with pytest.raises(TypeError, match="no collective algorithm"):
        choose(c, 10, 2)
    out = torch.ones(6)
    C.get("topk:0.5").decode_add(C.get("topk:0.5").compress(torch.arange(6.0)), out)
    assert out.tolist() == [1, 1, 1, 4, 5, 6]
