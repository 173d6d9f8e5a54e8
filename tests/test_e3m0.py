"""e3m0 (Streaming DiLoCo's 4-bit float outer gradients): the format's bound and levels on
ragged sizes, NaN blocks, the wire layout, meta tensors, error feedback, and the collectives."""
import pytest
import torch

import pyfast.compress as C
from pyfast.ops import e3m0

LEVELS = {0.0} | {s * 2.0 ** -k for k in range(7) for s in (1.0, -1.0)}


@pytest.mark.parametrize("n", [1, 7, 513, 2000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_and_levels(n, dtype):
    x = (torch.randn(n) * torch.rand(n) ** 4).to(dtype)  # heavy-tailed, like pseudo-gradients
    c = C.get("e3m0", block=256)
    p = c.compress(x)
    y = c.decompress(p)
    assert y.dtype == dtype and y.shape == x.shape
    xf, yf = x.float(), y.float()
    s = p.tensors["scales"].repeat_interleave(256)[:n]
    # ops/e3m0.py: |y - x| <= max(2^-7 s, |x| / 3); 2^-20 relative: the fp32 division |x| / s
    # may put m an ulp across a threshold; then half a bf16 ulp (2^-8 relative) for bf16
    slack = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
    bound = torch.maximum(2.0 ** -7 * s, xf.abs() / 3) * (1 + 2.0 ** -20) + slack * yf.abs()
    assert ((yf - xf).abs() <= bound).all()
    levels = e3m0.decode(p.tensors["codes"], p.tensors["scales"], n, 256) / s
    assert set(levels.tolist()) <= LEVELS
    assert (levels.abs().amax() == 1.0) and (levels.abs() == 1.0).sum() >= 1  # amax exact


def test_nan_block_decodes_to_nan_and_others_stay_finite():
    x = torch.randn(1000)
    x[600] = float("inf")
    y = C.get("e3m0").decompress(C.get("e3m0").compress(x))  # blocks of 512: [512, 1000) bad
    assert torch.isnan(y[512:]).all() and torch.isfinite(y[:512]).all()


def test_wire_layout_round_trip_and_decode_add():
    c = C.get("e3m0")
    x = torch.randn(1031)
    p = c.compress(x, "g")
    buf = c.to_wire(p)
    assert buf.numel() == p.nbytes == c.wire_bytes(1031) == 4 * 3 + 516
    q = c.from_wire(buf, x.shape, x.dtype)
    assert torch.equal(c.decompress(q), c.decompress(p))
    acc = torch.randn(1031)
    want = acc + c.decompress(p)
    assert torch.equal(c.decode_add(q, acc), want)
    assert (c.algorithm, c.lossy, c.deterministic, c.native_kind, c.block) == \
        ("dense", True, True, None, 512)


def test_meta_and_error_feedback():
    c = C.get("e3m0")
    dry = c.to_wire(c.compress(torch.randn(700, device="meta")))
    assert dry.is_meta and dry.numel() == c.wire_bytes(700)
    w = C.wrap(C.get("e3m0"))
    x = torch.randn(700)
    y = w.decompress(w.compress(x, "g"))
    torch.testing.assert_close(w.feedback.memory["g"], x - y, rtol=0, atol=0)  # exact in fp32


def test_bad_block():
    with pytest.raises(ValueError, match="e3m0 block must be a positive even integer"):
        C.get("e3m0", block=3)
