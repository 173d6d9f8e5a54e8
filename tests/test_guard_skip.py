"""check_finite="skip" with error feedback: the memory is double-buffered for the step
(ErrorFeedback.begin_step), so a skipped step leaves it bit for bit as a run that never saw
that step, on both engines, and the steps after it go on from there."""
import torch
from torch import nn

from pyfast.compress import get, wrap

ENGINES = ("native", "python")


def test_staged_memory_commits_or_rolls_back_without_copies():
    fb = wrap(get("int8"), True).feedback
    x = torch.randn(1000)  # ragged: not a multiple of the 512-element block
    fb.compress(x, "a")
    old = fb.memory["a"].clone()
    fb.begin_step()
    fb.compress(torch.randn(1000), "a")
    fb.compress(torch.randn(77), "new")  # first seen in a step that is then skipped
    assert torch.equal(fb.memory["a"], old)  # written beside it, not into it
    fb.rollback()
    assert set(fb.memory) == {"a"} and torch.equal(fb.memory["a"], old)
    y = torch.randn(1000)
    fb.begin_step()
    fb.compress(y, "a")
    fb.commit()
    ref = wrap(get("int8"), True).feedback  # never saw the rolled-back step
    ref.compress(x, "a")
    ref.compress(y, "a")
    assert torch.equal(fb.memory["a"], ref.memory["a"])  # same arithmetic, out of place


def _memory(net):
    return net.compression_state_dict()["state"]["feedback"]["memory"]


def _skip_vs_reference(rank, world):
    """Run A sees steps 0-4, step 2 non-finite on rank 1 (skipped everywhere); run B sees the
    same batches without step 2. After every step A's feedback memory and parameters equal B's
    bit for bit: same process, same engine, same arithmetic."""
    from pyfast.parallel.data import DataParallel

    def net():
        torch.manual_seed(3)  # odd widths: ragged buckets and quantization blocks
        return nn.Sequential(nn.Linear(29, 61), nn.Tanh(), nn.Linear(61, 7))

    out = {}
    for engine in ENGINES:
        runs = {}
        for name, steps in (("a", range(5)), ("b", (0, 1, 3, 4))):
            m = net()
            dp = DataParallel(m, "int8", bucket_mb=0.004, engine=engine)  # 2-3 buckets
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            rows = []
            for s in steps:
                g = torch.Generator().manual_seed(100 * s + rank)
                x, y = torch.randn(8, 29, generator=g), torch.randn(8, 7, generator=g)
                h = m[0].bias.register_hook(lambda t: t * float("inf")) \
                    if s == 2 and rank == 1 else None
                opt.zero_grad()
                nn.functional.mse_loss(dp(x), y).backward()
                if h is not None:
                    h.remove()
                if not dp.skipped:
                    opt.step()
                rows.append((s, dp.skipped, {k: v.clone() for k, v in _memory(dp).items()},
                             torch.cat([p.detach().reshape(-1) for p in m.parameters()])))
            dp.close()
            runs[name] = rows
        out[engine] = runs
    return out


def test_skipped_int8_step_leaves_the_memory_as_never_seen(pool2):
    out = pool2.run(_skip_vs_reference)
    for rank in range(2):
        for engine in ENGINES:
            a, b = out[rank][engine]["a"], out[rank][engine]["b"]
            assert [r[1] for r in a] == [False, False, True, False, False], (rank, engine)
            assert [r[1] for r in b] == [False] * 4, (rank, engine)
            for ra, rb in zip([r for r in a if r[0] != 2], b):
                assert ra[2].keys() == rb[2].keys(), (rank, engine, ra[0])
                assert all(torch.equal(ra[2][k], rb[2][k]) for k in ra[2]), (rank, engine, ra[0])
                assert torch.equal(ra[3], rb[3]), (rank, engine, ra[0])
            # the skipped step's memory is step 1's (it moved at every other step)
            assert all(torch.equal(a[2][2][k], a[1][2][k]) for k in a[1][2]), (rank, engine)
            assert not all(torch.equal(a[3][2][k], a[1][2][k]) for k in a[1][2])
    # the two engines agree bit for bit, the skipped step included (tests/test_engine.py)
    for ra, rb in zip(out[0]["native"]["a"], out[0]["python"]["a"]):
        assert torch.equal(ra[3], rb[3]), ra[0]
        assert all(torch.equal(ra[2][k], rb[2][k]) for k in ra[2]), ra[0]


def test_one_read_a_block_finds_any_non_finite_element():
    """check_finite="skip" folded into the quantization (comm.guard.folds): a NaN/Inf anywhere
    in any block, the ragged tail block included, shows at the one element a block that
    blocks_finite reads once decoded, for every block quantizer; a finite tensor passes."""
    from pyfast.ops.quantize import blocks_finite, dequantize, quantize
    n, block = 1000 + 37, 128  # 8 full blocks and a 13-element tail
    for kind in ("int8", "int4", "fp8", "sign"):
        x = torch.randn(n)
        codes, scales = quantize(x, kind, block)
        assert blocks_finite(dequantize(codes, scales, n, kind, block), block), kind
        for i in torch.randint(0, n, (6,)).tolist() + [n - 1, 1]:
            for bad in (float("nan"), float("inf"), -float("inf")):
                y = x.clone()
                y[i] = bad
                codes, scales = quantize(y, kind, block)
                assert not blocks_finite(dequantize(codes, scales, n, kind, block), block), \
                    (kind, i, bad)
