"""Compressed all_reduce at 2 and 4 gloo ranks against a single-process reference.

The reference simulates the ranks in one process with the same compressors and the same
summation order, so the dense and top-k algorithms must match it bitwise; where gloo does the
summation (none, randomk's values, PowerSGD's P and Q) its order is gloo's, so those compare
with rtol 1e-5 (a 4-term fp32 sum in another order: a few ulps). Every rank must hold
bit-identical results.

The reference shares the compressors with the code under test, so a compressor bug would pass
it: every result is also checked against the exact sum within the error the compression
allows (exact_error_bound).
"""
import pytest
import torch

import pyfast.compress as C
from dist_utils import RankPool

N = 70_007  # 7 x 10001, ragged: not a multiple of the 512-element block or of the world size
CASES = [("none", None), ("fp16", "allgather"), ("fp16", "two-phase"), ("bf16", "two-phase"),
         ("int8", "allgather"), ("int8", "two-phase"), ("int4", "two-phase"),
         ("fp8", "two-phase"), ("sign", "allgather"), ("sign", "two-phase"),
         ("topk:0.01", None), ("randomk:0.1", None), ("powersgd:2", None)]


def inputs(world, spec):
    shape = (7, N // 7) if spec.startswith("powersgd") else (N,)
    return [torch.randn(N, generator=torch.Generator().manual_seed(100 + r)) * (r + 1)
            for r in range(world)], shape


def reference(xs, spec, algo):
    """Single-process simulation of what the ranks compute."""
    world = len(xs)
    cs = [C.get(spec) for _ in range(world)]  # one compressor (state) per simulated rank
    dec = lambda c, x, nm: c.decompress(c.compress(x, nm)).float()  # noqa: E731
    if algo == "two-phase":
        out = torch.empty(N)
        per = -(-N // world)
        per = -(-per // getattr(cs[0], "block", 8)) * getattr(cs[0], "block", 8)
        for i in range(world):
            a, b = min(N, i * per), min(N, (i + 1) * per)
            acc = torch.zeros(b - a)
            for r in range(world):
                acc += dec(cs[r], xs[r][a:b], f"g.{i}")
            out[a:b] = dec(cs[i], acc, "g.sum")
        return out
    if spec in ("none",) or spec.startswith(("randomk", "powersgd")):
        return None  # gloo sums these; compared by tolerance below
    out = torch.zeros(N)
    for r in range(world):
        out += dec(cs[r], xs[r], "g")
    return out


def block_amax(t, block=512):
    """Each element's block maximum of |t| (blocks of 512 along the flat vector, as the
    quantizers' scales; two-phase chunks start at multiples of it)."""
    pad = torch.nn.functional.pad(t.abs(), (0, -t.numel() % block))
    return pad.view(-1, block).amax(1).repeat_interleave(block)[:t.numel()]


def exact_error_bound(xs, spec, algo):
    """Elementwise bound on |result - exact sum| from what each compression may lose, stated
    without running a compressor: a cast rounds by u|x| (u = 2^-11 fp16, 2^-8 bf16); a block
    quantizer by c * its block's max |x| (c = 1/254 int8, 1/14 int4, 2^-4 fp8 (e4m3: 3 mantissa
    bits), 1 sign); top-k drops values no larger than the smallest of the 1% it keeps. Two-phase
    compresses the partial sums once more. Plus 1e-5 of sum |x| for the fp32 sums' order.
    None for the specs compared with the exact sum directly."""
    mag = sum(x.abs() for x in xs)
    if spec in ("fp16", "bf16"):
        u = {"fp16": 2 ** -11, "bf16": 2 ** -8}[spec]
        err = u * mag
        if algo == "two-phase":
            err = err + u * (mag + err)
    elif spec in ("int8", "int4", "fp8", "sign"):
        c = {"int8": 1 / 254, "int4": 1 / 14, "fp8": 2 ** -4, "sign": 1.0}[spec]
        err = sum(c * block_amax(x) for x in xs)
        if algo == "two-phase":
            err = err + c * block_amax(mag + err)
    elif spec.startswith("topk"):
        k = max(1, int(0.01 * N) - 1)  # at least this many kept per rank
        err = sum(torch.topk(x.abs(), k).values[-1] for x in xs) * torch.ones(N)
    else:
        return None
    return err + 1e-5 * mag


def _worker(rank, world, mode):
    import os

    import pyfast.comm as comm
    for var in ("PYFAST_COMM_REFERENCE", "PYFAST_COMM_CHUNK"):  # the pool's previous job's
        os.environ.pop(var, None)
    if mode == "reference":
        os.environ["PYFAST_COMM_REFERENCE"] = "1"
    else:  # the in-place pipelined path, with chunks small enough to pipeline 70K elements
        os.environ["PYFAST_COMM_CHUNK"] = "4096"
    results = {}
    for spec, algo in CASES:
        xs, shape = inputs(world, spec)
        t = xs[rank].clone().view(shape)
        comm.all_reduce(t, spec, name="g", algorithm=algo)
        results[(spec, algo)] = t.reshape(-1)
    avg = xs[rank].clone()
    comm.all_reduce(avg, "int8", op="avg", name="g")
    results["avg"] = avg
    return results


@pytest.fixture(scope="module", params=[2, 4])
def pool(request):
    """Ranks spawned once per world size for every case (a spawn costs ~2 s a rank here)."""
    with RankPool(request.param) as p:
        yield p


@pytest.mark.parametrize("mode", ["reference", "pipelined"])
def test_all_reduce_matches_reference_and_ranks_agree(pool, mode):
    world = pool.world_size
    out = pool.run(_worker, mode)
    for spec, algo in CASES:
        got = [o[(spec, algo)] for o in out]
        for r in range(1, world):
            assert torch.equal(got[r], got[0]), f"{spec}/{algo}: rank {r} differs from rank 0"
        xs, _ = inputs(world, spec)
        exact = sum(xs)
        ref = reference(xs, spec, algo)
        if ref is not None:
            assert torch.equal(got[0], ref), f"{spec}/{algo}: differs from the reference"
            bound = exact_error_bound(xs, spec, algo)
            off = (got[0] - exact).abs() > bound
            assert not off.any(), (f"{spec}/{algo}: {int(off.sum())} of {N} beyond the error "
                                   f"bound from the exact sum, e.g. at {int(off.nonzero()[0])}")
        elif spec == "none":
            torch.testing.assert_close(got[0], exact, rtol=1e-5, atol=1e-5)
        elif spec.startswith("randomk"):
            kept = got[0] != 0
            assert 0.05 * N < kept.sum() < 0.15 * N
            torch.testing.assert_close(got[0][kept], exact[kept], rtol=1e-5, atol=1e-5)
        else:  # powersgd: the rank-2 approximation of the summed matrix, one power iteration
            m = exact.view(7, -1)
            err = (got[0].view(7, -1) - m).norm() / m.norm()
            best = torch.linalg.svdvals(m)[2:].norm() / m.norm()  # optimal rank-2 error
            assert best <= err <= best * 1.5 + 1e-6
    xs, _ = inputs(world, "int8")
    assert torch.equal(out[0]["avg"], reference(xs, "int8", "allgather" if world == 2 else
                                                "two-phase" if N > 256 * 1024 else "allgather")
                       / world)


def _nan_worker(rank, world):
    import torch.distributed as dist

    import pyfast.comm as comm
    out = {}
    for spec, algo in CASES:
        xs, shape = inputs(world, spec)
        t = xs[rank].clone()
        if rank == world - 1:
            t[123] = float("nan")
        try:
            comm.all_reduce(t.view(shape), spec, name="g", algorithm=algo)
            out[spec, algo] = ("ok", bool(torch.isfinite(t).all()))
        except comm.NonFiniteGradient as e:
            out[spec, algo] = ("raised", str(e))
    ok = torch.ones(8)  # the group is still in step after every case
    dist.all_reduce(ok)
    out["after"] = ok
    return out


def test_nan_on_one_rank_same_outcome_everywhere(pool):
    """A NaN on the last rank only: every rank raises the same NonFiniteGradient naming it
    (top-k, random-k refuse NaN), or every rank holds a non-finite result (the others carry it
    through). Never one rank raising while the others wait in a collective."""
    world = pool.world_size
    out = pool.run(_nan_worker)
    for spec, algo in CASES:
        seen = [o[spec, algo] for o in out]
        assert all(s == seen[0] for s in seen), f"{spec}/{algo}: ranks disagree: {seen}"
        kind, detail = seen[0]
        if kind == "raised":
            assert f"rank(s) [{world - 1}]" in detail, detail
        else:
            assert detail is False, f"{spec}/{algo}: the NaN vanished"
    assert all(torch.equal(o["after"], torch.full((8,), float(world))) for o in out)


def _topk_feedback_worker(rank, world, mode):
    import os

    import pyfast.comm as comm
    os.environ.pop("PYFAST_COMM_REFERENCE", None)
    os.environ["PYFAST_COMM_CHUNK"] = "4096"  # 18 parts of N: selected while others travel
    if mode == "reference":
        os.environ["PYFAST_COMM_REFERENCE"] = "1"
    c = C.WithFeedback(C.get("topk:0.01"))
    xs, _ = inputs(world, "topk:0.01")
    out = []
    for step, x in enumerate([xs[rank], torch.ones(N)]):  # ones: ties past the cap
        t = x.clone()
        comm.all_reduce(t, c, name="g" if step == 0 else "ones")
        out.append(t)
    t = xs[rank].clone()
    comm.all_reduce(t, c, name="g")  # again: selects from x + the first call's memory
    out.append(t)
    return out, {k: v.clone() for k, v in c.feedback.memory.items()}


def test_topk_parts_with_feedback_match_reference(pool):
    """The pipelined top-k (selected and sent in parts) leaves the same results and the same
    error-feedback memory as the one-gather reference, bitwise: same threshold, same
    selection, same rank-order sums (exact fp32 arithmetic in the same order)."""
    ref = pool.run(_topk_feedback_worker, "reference")
    got = pool.run(_topk_feedback_worker, "pipelined")
    for r, ((g_out, g_ef), (r_out, r_ef)) in enumerate(zip(got, ref)):
        assert all(torch.equal(a, b) for a, b in zip(g_out, r_out)), f"rank {r}: results"
        assert g_ef.keys() == r_ef.keys() == {"g", "ones"}
        assert all(torch.equal(g_ef[k], r_ef[k]) for k in g_ef), f"rank {r}: feedback"
    from pyfast.ops.topk import target
    hi = target(N, 0.01)[2]  # ones: every rank's cap cuts at the same index
    ones = got[0][0][1]
    assert torch.equal(ones[:hi], torch.full((hi,), float(pool.world_size)))
    assert not ones[hi:].any()
