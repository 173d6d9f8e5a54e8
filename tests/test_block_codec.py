"""compress.block.BlockCodec, the one class behind e3m0 and ternary, against what the two
classes it replaced sent (their compress, written out: the format's ops.encode, for ternary
with the seed derived from (seed, name, step)): the wire bytes and the decoded tensors bit for
bit, on fresh random ragged inputs, in every float dtype, with and without error feedback."""
import pytest
import torch

import pyfast.compress as C
from pyfast.compress.base import derive_seed
from pyfast.ops import e3m0, ternary


def old_wire(spec, x, block, seed, step, name):
    """The replaced E3M0 / Ternary's payload as bytes: scales then codes."""
    if spec == "e3m0":
        codes, scales = e3m0.encode(x, block)
    else:
        codes, scales = ternary.encode(x, block, derive_seed(seed, name, step))
    return torch.cat([scales.reshape(-1).view(torch.uint8), codes.reshape(-1)]), codes, scales


@pytest.mark.parametrize("spec,opts", [("e3m0", {}), ("e3m0", {"block": 256}),
                                       ("ternary", {}), ("ternary", {"block": 64, "seed": 9})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_the_replaced_classes(spec, opts, dtype):
    ops = e3m0 if spec == "e3m0" else ternary
    block, seed = opts.get("block", ops.DEFAULT_BLOCK), opts.get("seed", 0)
    c = C.get(spec, **opts)
    for n in (1, 7, 513, 3001):  # ragged: partial last blocks and code bytes
        x = (torch.randn(n) * torch.rand(n) ** 2).to(dtype)
        x[torch.randint(n, ())] *= 50  # one outlier sets its block's scale
        for step in range(2):  # ternary: a new draw each step
            p = c.compress(x, f"g{n}")
            want, codes, scales = old_wire(spec, x, block, seed, step, f"g{n}")
            assert torch.equal(c.to_wire(p), want)
            assert list(p.tensors) == ["scales", "codes"] and p.nbytes == c.wire_bytes(n)
            y = c.decompress(p)
            assert y.dtype == dtype and y.shape == x.shape
            assert torch.equal(y, ops.decode(codes, scales, n, block, dtype).view(x.shape))
    assert (c.algorithm, c.lossy, c.native_kind, c.block) == ("dense", True, None, block)
    assert c.deterministic == (spec == "e3m0")
    assert c.state_dict() == ({} if spec == "e3m0" else {"steps": {f"g{n}": 2 for n in
                                                                   (1, 7, 513, 3001)}})


def test_error_feedback_and_bad_options():
    for spec in ("e3m0", "ternary"):
        w, x = C.wrap(C.get(spec)), torch.randn(1031)
        ef = w.feedback
        p = w.compress(x, "g")
        # what was not sent stays in the memory, exactly (fp32)
        assert torch.equal(ef.memory["g"], x - w.decompress(p))
    with pytest.raises(ValueError, match="bad options"):
        C.get("e3m0", seed=1)  # deterministic: no seed, as before
    with pytest.raises(ValueError, match="ternary block must be a positive multiple of 4"):
        C.get("ternary", block=6)
    with pytest.raises(ValueError, match="keeps no state"):
        C.get("e3m0").load_state_dict({"steps": {}})
