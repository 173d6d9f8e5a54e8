"""The native engine's compressed reduce_scatter / all_gather (NativeEngine.reduce_scatter,
.all_gather) against pyfast.comm.reduce_scatter / all_gather (comm/sharded.py), at 2 and 4 gloo
ranks: bitwise equal outputs and error-feedback memories (same names), over two steps so the
memories feed back, every compressor the engine codes, with and without error feedback, sizes
whose payloads are not multiples of 8 bytes (the engine pads its slots, the reference does not),
an empty tensor, jobs of both kinds queued together and waited in reverse order.
"""
import pytest
import torch

from dist_utils import RankPool

KINDS = ["none", "fp16", "bf16", "int8", "int4", "fp8", "sign"]
CASES = [(k, fb) for k in KINDS for fb in ([False] if k == "none" else [False, True])]
PER = [3, 513, 4099, 0]  # elements per rank: 6-byte bf16 payloads, int8 521 bytes, none


def inputs(rank, n, step):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + n)
    return torch.randn(n, generator=g) * (rank + 1)


def bits(t):
    return t.view(torch.int32)


def _worker(rank, world):
    import pyfast.comm as comm
    import pyfast.compress as C
    from pyfast.comm.engine import NativeEngine
    engine = NativeEngine.private()
    make = lambda k, fb: C.WithFeedback(C.get(k)) if fb else C.get(k)  # noqa: E731
    cases = [(per, *c) for per in PER for c in CASES]
    mine = {c: (make(c[1], c[2]), make(c[1], c[2])) for c in cases}  # (rs, ag) compressors
    ref = {c: (make(c[1], c[2]), make(c[1], c[2])) for c in cases}
    bad, outs = [], {}
    for step in range(2):
        jobs = []
        for i, c in enumerate(cases):
            per, op = c[0], "avg" if i % 2 else "sum"
            x, y = inputs(rank, world * per, step), inputs(rank, per, step + 7)
            rs, ag = torch.full((per,), float("nan")), torch.full((world * per,), float("nan"))
            jobs.append((c, op, x, y, rs, ag,
                         engine.reduce_scatter(rs, x, mine[c][0], op=op, name=f"u{i}"),
                         engine.all_gather(ag, y, mine[c][1], name=f"p{i}")))
        for c, op, x, y, rs, ag, h1, h2 in reversed(jobs):
            assert h2.wait() is ag and h1.wait() is rs
        for i, (c, op, x, y, rs, ag, _, _) in enumerate(jobs):
            want_rs, want_ag = torch.empty_like(rs), torch.empty_like(ag)
            comm.reduce_scatter(want_rs, x, ref[c][0], op=op, name=f"u{i}")
            comm.all_gather(want_ag, y, ref[c][1], name=f"p{i}")
            if not torch.equal(bits(rs), bits(want_rs)):
                bad.append(f"step {step} {c} {op}: reduce_scatter differs from comm's")
            if not torch.equal(bits(ag), bits(want_ag)):
                bad.append(f"step {step} {c}: all_gather differs from comm's")
            for j, what in enumerate(("reduce_scatter", "all_gather")):
                a, b = mine[c][j].feedback, ref[c][j].feedback
                if a is None:
                    continue
                a, b = a.memory, b.memory
                if a.keys() != b.keys() or any(not torch.equal(bits(a[k]), bits(b[k])) for k in a):
                    bad.append(f"step {step} {c}: {what}'s error feedback {sorted(a)} vs "
                               f"{sorted(b)}")
            outs[(step, c)] = ag
    for call, words in [
            (lambda: engine.reduce_scatter(torch.empty(3), torch.ones(3 * world + 1), "int8"),
             "elements"),
            (lambda: engine.all_gather(torch.empty(world * 3 + 1), torch.ones(3), "int8"),
             "elements"),
            (lambda: engine.reduce_scatter(torch.empty(3), torch.ones(3 * world), "topk:0.5"),
             "does not run topk"),
            (lambda: engine.all_gather(torch.empty(world * 3), torch.ones(3), "ternary"),
             "does not run ternary"),
            (lambda: engine.reduce_scatter(torch.empty(3), torch.ones(3 * world), op="max"),
             "op must be"),
            (lambda: engine.all_gather(torch.empty(world * 3, dtype=torch.float64),
                                       torch.ones(3, dtype=torch.float64)), "float32")]:
        try:
            call()
            bad.append(f"no error, expected {words!r}")
        except (ValueError, TypeError) as e:
            if words not in str(e):
                bad.append(f"expected {words!r}, got {e}")
    engine.close()
    return bad, outs


@pytest.mark.parametrize("world", [2, 4])
def test_engine_sharded_matches_comm_bitwise(world):
    with RankPool(world) as pool:
        out = pool.run(_worker, timeout=300)
    for rank, (bad, _) in enumerate(out):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)
    for key, t in out[0][1].items():  # every rank gathered the same bits
        for r in range(1, world):
            assert torch.equal(bits(out[r][1][key]), bits(t)), f"{key}: rank {r} differs"
