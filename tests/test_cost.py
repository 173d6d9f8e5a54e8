"""pyfast.comm.cost: the overlap arithmetic and the link fit on hand-made numbers, the bytes
model against what a rank really writes to its sockets, the fitted link identical on every
rank, codec passes per algorithm, and the error measure auto weighs."""
import math

import pytest
import torch

import pyfast.compress as C
from pyfast.comm import cost

SPECS = ["none", "bf16", "int8", "int4", "sign", "topk:0.01", "randomk:0.01", "powersgd:4"]


def test_predict_step_overlaps_in_order():
    # both buckets done long before backward ends: nothing exposed
    p = cost.predict_step(0.010, [0.002, 0.005], [0.001, 0.001], tail_s=0.003)
    assert p["step_s"] == pytest.approx(0.013) and p["exposed_s"] == pytest.approx(0.0)
    # bucket 1 waits for bucket 0 (FIFO): 8 -> 12, then 12 -> 16; backward ends at 10
    p = cost.predict_step(0.010, [0.008, 0.010], [0.004, 0.004], tail_s=0.001)
    assert p["step_s"] == pytest.approx(0.017) and p["exposed_s"] == pytest.approx(0.006)
    assert p["comm_s"] == pytest.approx(0.008)
    # every bucket ready only when backward ends: all of the communication is exposed
    p = cost.predict_step(0.010, [0.010, 0.010], [0.003, 0.002])
    assert p["step_s"] == pytest.approx(0.015) and p["exposed_s"] == pytest.approx(0.005)
    # no buckets (one rank, or nothing to reduce): the step is compute + tail
    assert cost.predict_step(0.010, [], [], tail_s=0.002)["step_s"] == pytest.approx(0.012)


def test_fit_recovers_latency_slope_and_free_bytes():
    alpha, beta, free = 4e-4, 160e-9, 100_000  # 100 Mbit/s shared by 2 ranks, 100 KB burst
    xs = list(cost.SIZES)
    ys = [alpha + beta * max(0, x - free) for x in xs]
    a, b, f = cost._fit(xs, ys)
    assert (a, b) == (pytest.approx(alpha), pytest.approx(beta)) and f == pytest.approx(free)
    link = cost.LinkModel({p: (a, b, f) for p in cost.PRIMITIVES}, 3e-4)
    assert link.seconds("all_gather", 50_000) == pytest.approx(alpha)  # inside the burst
    assert link.seconds("all_gather", 600_000) == pytest.approx(alpha + beta * 500_000)
    assert cost._fit(xs, [1e-3, 2e-3, 1.5e-3])[1:] == (0.0, 0.0)  # noise: no negative slope


def test_codec_passes_follow_the_algorithm():
    link = cost.LinkModel({p: (1e-3, 0.0, 0.0) for p in cost.PRIMITIVES}, 1e-4)
    codec = (0.002, 0.001)
    ag = cost.comm_seconds(C.get("int8"), (1000,), 2, link, codec)  # W=2: allgather
    assert (ag["encode_s"], ag["decode_s"]) == (0.002, pytest.approx(0.002))
    assert ag["wire_s"] == pytest.approx(1e-4 + 1e-3)  # size exchange + all-gather
    big = (4 << 20,)  # past ALLGATHER_MAX_BYTES at W=4: two-phase
    tp = cost.comm_seconds(C.get("int8"), big, 4, link, codec)
    assert tp["encode_s"] == pytest.approx(0.002 * 1.25) and tp["decode_s"] == pytest.approx(0.002)
    assert tp["wire_s"] == pytest.approx(1e-3 + 1e-4 + 1e-3)
    native = cost.comm_seconds(C.get("none"), (1000,), 4, link, codec)
    assert native["total_s"] == pytest.approx(1e-3)  # one all-reduce, no codec
    psgd = cost.wire_calls(C.get("powersgd:4"), (301, 257), 2)
    assert psgd == [("all_reduce", 4.0 * 301 * 4), ("all_reduce", 4.0 * 257 * 4)]
    assert cost.wire_calls(C.get("powersgd:4"), (257,), 2) == [("all_reduce", 4.0 * 257)]


def test_relative_error_orders_the_quantizers():
    x = torch.randn(40_000) * torch.logspace(-3, 0, 40_000)  # scales 1000x apart
    err = {s: cost.relative_error(C.get(s), x) for s in ("none", "fp16", "int8", "fp8", "int4")}
    assert err["none"] == 0.0 and err["fp16"] < 1e-3
    assert err["fp16"] < err["int8"] < err["fp8"] < err["int4"] < 0.5, err
    assert cost.relative_error(C.get("int8"), torch.zeros(10)) == 0.0
    assert cost.convergence_seconds(0.2, 0.05, 0.5) == pytest.approx(
        cost.STEPS_PER_ERROR * 0.2 * 0.05 * 0.5)


def _sent(rank, world, shape):
    import torch.distributed as dist

    from pyfast.comm import collectives
    from pyfast.train.telemetry import bytes_written
    torch.manual_seed(rank)
    out = {}
    for spec in SPECS:
        t = torch.randn(shape)
        c = C.get(spec)
        collectives.all_reduce(t.clone(), c, op="avg", name="w")  # warm: connections, state
        dist.barrier()
        w0 = bytes_written()
        collectives.all_reduce(t, c, op="avg", name="w")
        out[spec] = bytes_written() - w0
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sent_bytes_match_what_a_rank_writes(world, pool2, pool4):
    """wchar of /proc/self/io counts every byte a rank passes to write(): gloo's TCP sends plus
    its framing. Tolerance: 3% + 1 KB per primitive call (gloo's headers, the size exchanges'
    few bytes) -- measured below 1% + 200 B on this machine."""
    shape = (301, 257)  # ragged: no compressor block divides 77,357; a matrix for PowerSGD
    pool = pool2 if world == 2 else pool4
    measured = pool.run(_sent, shape)
    for spec in SPECS:
        model = cost.sent_bytes(C.get(spec), shape, world)
        calls = len(cost.wire_calls(C.get(spec), shape, world))
        for rank, got in enumerate(m[spec] for m in measured):
            assert abs(got - model) <= 0.03 * model + 1024 * calls * world, \
                (spec, world, rank, got, model)


def _link(rank, world):
    m = cost.measure_link(sizes=(1 << 8, 1 << 12, 1 << 16), repeats=3)
    return m.fits, m.small_s


def test_measure_link_gives_every_rank_the_same_model(pool2):
    (f0, s0), (f1, s1) = pool2.run(_link)
    assert f0 == f1 and s0 == s1
    assert set(f0) == set(cost.PRIMITIVES) and s0 > 0
    for alpha, beta, free in f0.values():
        assert alpha > 0 and beta >= 0 and free >= 0 and math.isfinite(alpha + beta + free)
