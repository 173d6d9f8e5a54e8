"""The compressor -> comm contract: the collectives choose from what a compressor declares
(base.Compressor's algorithm, block, per_tensor, lossy, native_kind, wire_bytes, decode_add,
base / feedback), never from its type; NaN/Inf are a NonFiniteGradient raised where found; one
Handle for asynchronous work."""
import pytest
import torch

import pyfast.comm as comm
import pyfast.compress as C
from pyfast.comm import engine
from pyfast.comm.collectives import Handle, choose
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
    assert engine._kind(c) is None  # no native_kind declared: only the Python path
    c.native_kind = "fp16"
    assert engine.NativeEngine.supports(c)
    c.algorithm = "nonsense"
    with pytest.raises(TypeError, match="no collective algorithm"):
        choose(c, 10, 2)
    out = torch.ones(6)
    C.get("topk:0.5").decode_add(C.get("topk:0.5").compress(torch.arange(6.0)), out)
    assert out.tolist() == [1, 1, 1, 4, 5, 6]


def test_nonfinite_raised_by_the_compressor():
    import pyfast.errors
    assert comm.NonFiniteGradient is C.NonFiniteGradient is pyfast.errors.NonFiniteGradient
    assert issubclass(C.NonFiniteGradient, ValueError)
    x = torch.randn(100)
    x[3] = float("nan")
    for spec in ("topk:0.1", "randomk:0.1"):
        with pytest.raises(C.NonFiniteGradient, match="NaN/Inf"):
            C.get(spec).compress(x, "a")
    with pytest.raises(C.NonFiniteGradient):
        C.wrap(C.get("topk:0.1")).compress(x, "a")
    with pytest.raises(TypeError):  # other refusals keep their type
        C.get("topk:0.1").compress(torch.zeros(4, dtype=torch.int32))


def test_one_handle():
    from pyfast.comm import sharded
    from pyfast.parallel import data
    assert isinstance(engine._job_handle(None, 0, None, "x"), Handle) and not hasattr(data, "_All")
    assert engine.Handle is Handle  # exactly one thing called Handle
    assert sharded.Handle is Handle
    calls = []

    def join(timeout):
        calls.append(timeout)
        return "r", 0.5
    h = Handle(join, lambda: 0.25)
    assert h.seconds == 0.25 and not h.is_completed()
    assert h.wait() == "r" and h.wait() == "r" and calls == [None]
    assert h.seconds == 0.5 and h.is_completed()

    def boom(timeout):
        raise RuntimeError("x")
    bad = Handle(boom)
    both = Handle.of_all([h, bad])
    with pytest.raises(RuntimeError):
        both.wait()
    with pytest.raises(RuntimeError):
        bad.wait()  # the same error again, the work is not re-run
    import math
    assert math.isnan(bad.seconds)
    assert Handle.of_all([h, h]).wait() == ["r", "r"]
    assert Handle.of_all([h, h]).seconds == 1.0
    f = Handle.on_worker(lambda a: a + 1, 41)
    assert f.wait(5) == 42 and f.seconds >= 0 and f.is_completed()
