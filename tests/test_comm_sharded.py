"""Compressed reduce_scatter and all_gather at 2 and 4 gloo ranks against a single-process
simulation.

The simulation compresses every rank's chunk with its own compressor object (same specs, seeds
and names) and sums in rank order, so every compressed result must match it bitwise. For
"none" gloo sums the chunks: at W=2 a two-term fp32 sum has one possible value, so it is
compared bitwise too; at W=4 gloo's order is its own, so the check is the bound for any summation order, error
<= (W-1) u sum|x_r| (u = 2^-24), plus half an ulp of the output dtype for 16-bit tensors.
"""
import pytest
import torch

import pyfast.compress as C
from pyfast.compress.quant import Quantizer
from dist_utils import run_ranks

SPECS = ["none", "fp16", "bf16", "int8", "int4", "fp8", "sign", "topk:0.1", "randomk:0.1"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PER = 1023  # elements per rank: ragged, neither a multiple of the 512-element block nor of 8
EF = ["int8", "topk:0.1"]  # with error feedback, two calls under one name


def shape(world):
    return (world * 3, PER // 3)  # any shape: reduce_scatter works on the flat view


def inputs(world, dtype, seed=100, n=None):
    n = n or world * PER
    return [(torch.randn(n, generator=torch.Generator().manual_seed(seed + r)) * (r + 1)).to(dtype)
            for r in range(world)]


def factory(spec, ef=False):
    return (lambda: C.WithFeedback(C.get(spec))) if ef else (lambda: C.get(spec))


def _catch(fn):
    try:
        fn()
    except Exception as e:  # the test checks the type and the message on every rank
        return type(e).__name__, str(e)
    return None


def _worker(rank, world):
    import pyfast.comm as comm
    res = {}
    for spec in SPECS:
        for dt in DTYPES:
            for op in ("sum", "avg") if spec in ("none", "int8") else ("sum",):
                t = inputs(world, dt)[rank].view(shape(world))
                out = torch.empty(PER, dtype=dt)
                comm.reduce_scatter(out, t, spec, op=op, name="g")
                res["rs", spec, dt, op] = out
            t = inputs(world, dt, n=PER)[rank].view(3, -1)
            out = torch.empty(world * 3, PER // 3, dtype=dt)
            comm.all_gather(out, t, spec, name="g")
            res["ag", spec, dt] = out
    for spec in EF:
        c = factory(spec, ef=True)()
        for step, seed in enumerate((100, 200)):
            out = torch.empty(PER)
            comm.reduce_scatter(out, inputs(world, torch.float32, seed)[rank], c, name="g")
            res["rs-ef", spec, step] = out
    h = comm.reduce_scatter(torch.empty(PER), inputs(world, torch.float32)[rank], "int4",
                            async_op=True, name="g")
    h2 = comm.all_gather(torch.empty(world * PER), inputs(world, torch.float32, n=PER)[rank],
                         "int4", async_op=True, name="g")
    res["rs-async"], res["ag-async"] = h.wait(), h2.wait()

    x = inputs(world, torch.float32)[rank]
    n = x.numel()
    nan = x.clone()
    if rank == 1:
        nan[5] = float("nan")
    rs, ag = comm.reduce_scatter, comm.all_gather
    bad = {
        "indivisible": lambda: rs(torch.empty(PER), torch.randn(n + 1)),
        "out-size": lambda: rs(torch.empty(PER - 1), x),
        "out-size-rank1": lambda: rs(torch.empty(PER - (rank == 1)), x),
        "out-dtype": lambda: rs(torch.empty(PER, dtype=torch.float16), x),
        "shape-rank1": lambda: rs(torch.empty(PER), x.view(world, -1) if rank == 1 else x),
        "dtype-rank1": lambda: rs(torch.empty(PER), x.double() if rank == 1 else x),
        "int64": lambda: rs(torch.empty(PER, dtype=torch.int64), x.long()),
        "op": lambda: rs(torch.empty(PER), x, op="max"),
        "powersgd": lambda: rs(torch.empty(PER), x, "powersgd:2"),
        "ag-out-size": lambda: ag(torch.empty(n - 1), x[:PER]),
        "ag-powersgd": lambda: ag(torch.empty(n), x[:PER], "powersgd:2"),
        "nan-topk": lambda: rs(torch.empty(PER), nan, "topk:0.1", name="nan"),
        "nan-randomk": lambda: rs(torch.empty(PER), nan, "randomk:0.1", name="nan"),
        "ag-nan-topk": lambda: ag(torch.empty(world * n), nan, "topk:0.1", name="nan"),
    }
    res["errors"] = {k: _catch(f) for k, f in bad.items()}
    res["empty"] = (rs(torch.empty(0), torch.empty(0), "int8"),
                    ag(torch.empty(0), torch.empty(0), "topk:0.1"))
    res["after-errors"] = rs(torch.empty(PER), x, "int8", name="g")  # the group is still in step
    return res


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    world = request.param
    return world, run_ranks(_worker, world)


def dec_sum(c, x, name):
    """What a rank adds for one received chunk: _decode_add's fused kernel accumulates the
    quantizers' fp32 values without first rounding them to x's dtype."""
    p = c.compress(x, name)
    if isinstance(getattr(c, "inner", c), Quantizer):
        p.dtype = torch.float32
    return c.decompress(p).reshape(-1).float()


def rs_reference(make, *steps, op="sum"):
    """out[rank][call] for successive calls with inputs steps[call] (one tensor per rank)."""
    world = len(steps[0])
    cs = [make() for _ in range(world)]
    outs = [[] for _ in range(world)]
    for xs_step in steps:
        for i in range(world):
            acc = torch.zeros(PER)
            for r in range(world):
                acc += dec_sum(cs[r], xs_step[r].reshape(-1)[i * PER:(i + 1) * PER], f"g.{i}")
            outs[i].append((acc / world if op == "avg" else acc).to(xs_step[0].dtype))
    return outs


def check_exact_sum(got, xs, world, op):
    """'none': gloo's fp32 sum, checked against the bound for any summation order."""
    dt = xs[0].dtype
    x64 = torch.stack([x.double() for x in xs])
    exact, mag = x64.sum(0), x64.abs().sum(0)
    if op == "avg":
        exact, mag = exact / world, mag / world
    tol = (world - 1) * 2.0 ** -24 * mag  # W-1 fp32 additions in whatever order
    if dt != torch.float32:  # then one rounding to dt: half an ulp, or of a subnormal step
        fi = torch.finfo(dt)
        tol = tol + fi.eps / 2 * exact.abs() + fi.smallest_normal * fi.eps / 2
    for i, g in enumerate(got):
        err = (g.double() - exact[i * PER:(i + 1) * PER]).abs()
        assert (err <= tol[i * PER:(i + 1) * PER] * 1.001).all(), f"none/{dt}/{op}: rank {i}"
    if world == 2:  # one possible fp32 sum of two terms: bitwise
        s = xs[0].float() + xs[1].float()
        ref = (s / 2 if op == "avg" else s).to(dt)
        assert torch.equal(torch.cat(got), ref), f"none/{dt}/{op}: differs from x0 + x1"


def test_reduce_scatter_matches_simulation(ranks):
    world, out = ranks
    for (kind, spec, dt, op) in [k for k in out[0] if k[0] == "rs"]:
        got = [o[kind, spec, dt, op] for o in out]
        assert all(g.dtype == dt and g.shape == (PER,) for g in got)
        xs = inputs(world, dt)
        if spec == "none":
            check_exact_sum(got, xs, world, op)
            continue
        ref = rs_reference(factory(spec), xs, op=op)
        for r in range(world):
            assert torch.equal(got[r], ref[r][0]), f"{spec}/{dt}/{op}: rank {r} differs"
    for spec in EF:
        ref = rs_reference(factory(spec, ef=True), *[inputs(world, torch.float32, s)
                                                     for s in (100, 200)])
        for r in range(world):
            for step in (0, 1):
                assert torch.equal(out[r]["rs-ef", spec, step], ref[r][step]), \
                    f"{spec} with error feedback, call {step}: rank {r} differs"
    ref = rs_reference(factory("int4"), inputs(world, torch.float32))
    assert all(torch.equal(out[r]["rs-async"], ref[r][0]) for r in range(world))
    ref = rs_reference(factory("int8"), inputs(world, torch.float32))
    assert all(torch.equal(out[r]["after-errors"], ref[r][0]) for r in range(world))


def test_all_gather_matches_simulation_and_ranks_agree(ranks):
    world, out = ranks
    for spec in SPECS:
        for dt in DTYPES:
            got = [o["ag", spec, dt] for o in out]
            for r in range(1, world):
                assert torch.equal(got[r], got[0]), f"{spec}/{dt}: rank {r} differs from rank 0"
            xs = inputs(world, dt, n=PER)
            cs = [C.get(spec) for _ in range(world)]
            ref = torch.cat([cs[r].decompress(cs[r].compress(xs[r], "g")).reshape(-1)
                             for r in range(world)])
            assert got[0].shape == (world * 3, PER // 3)
            assert torch.equal(got[0].reshape(-1), ref), f"{spec}/{dt}: differs from simulation"
            if spec == "none":
                assert torch.equal(ref, torch.cat(xs))
    xs = inputs(world, torch.float32, n=PER)
    cs = [C.get("int4") for _ in range(world)]
    ref = torch.cat([c.decompress(c.compress(x, "g")) for c, x in zip(cs, xs)])
    assert all(torch.equal(o["ag-async"], ref) for o in out)


def test_bad_inputs_fail_on_every_rank(ranks):
    world, out = ranks
    n = world * PER
    expect = {  # name -> (exception, words the message must hold)
        "indivisible": ("ValueError", [str(n + 1), f"world size {world}"]),
        "out-size": ("ValueError", [str(PER - 1), str(PER)]),
        "out-size-rank1": ("ValueError", [str(PER - 1), str(PER), "rank(s) [1]"]),
        "out-dtype": ("TypeError", ["torch.float16", "torch.float32"]),
        "shape-rank1": ("ValueError", ["differ across ranks", f"rank 1 has ({world}, {PER})"]),
        "dtype-rank1": ("ValueError", ["differ across ranks", "rank 1 has", "torch.float64"]),
        "int64": ("TypeError", ["torch.int64"]),
        "op": ("ValueError", ["reduce_scatter", "'max'"]),
        "powersgd": ("ValueError", ["powersgd", "chunk", "all_reduce"]),
        "ag-out-size": ("ValueError", [str(n - 1), str(n)]),
        "ag-powersgd": ("ValueError", ["powersgd", "all_reduce"]),
        "nan-topk": ("NonFiniteGradient", ["rank(s) [1]"]),
        "nan-randomk": ("NonFiniteGradient", ["rank(s) [1]"]),
        "ag-nan-topk": ("NonFiniteGradient", ["rank(s) [1]"]),
    }
    assert all(o["empty"][0].numel() == o["empty"][1].numel() == 0 for o in out)
    for key, (exc, words) in expect.items():
        for r in range(world):
            got = out[r]["errors"][key]
            assert got is not None and got[0] == exc, f"{key}: rank {r} got {got}"
            assert all(w in got[1] for w in words), f"{key}: rank {r}: {got[1]!r} lacks {words}"
