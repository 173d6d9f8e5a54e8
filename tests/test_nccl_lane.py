"""The NCCL-semantics lane (tests/nccl_lane.py): every point-to-point user of pyfast on gloo with
every tag forced to 0, so messages between two ranks pair in posting order as under NCCL,
against the same dense references as the tag-keeping tests: ring attention (2 and 4 ranks,
causal zigzag and contiguous, not causal; one and several head passes), every pipeline
schedule over two steps of different batch sizes (and a failing step: the failure reaches
every rank, and a new Pipeline on the same ranks works), async TP's two functions forward and
backward. Each run's p2p calls are also checked against NCCL's one stream per pair of ranks
(nccl_lane.nccl_deadlock: no receive queued before a send it waits for, on both sides).
Tolerances are those of the tests whose rank jobs are reused here (each states its reason);
nothing is looser under the lane, which changes only how messages pair.
"""
import pytest
import torch

from nccl_lane import nccl_deadlock, run_logged, run_tag0
import test_async_tp as atp
import test_context_parallel as cp
import test_pipeline as pp
import test_pipeline_failures as pf

pytestmark = pytest.mark.dist


def _logged(pool, fn, *args):
    """fn's values on the pool's ranks under the lane, after checking that the p2p calls
    they made would not hang under NCCL (nccl_deadlock)."""
    got = pool.run(run_logged, fn, *args)
    hang = nccl_deadlock([log for _, log in got])
    assert hang is None, hang
    return [value for value, _ in got]


# -- the lane itself ---------------------------------------------------------------------------
def _pairing(rank, world, lane):
    """Rank 0 sends A then B (tags 1, 2, same size); rank 1 posts the receive for tag 2 first.
    By tag, the first buffer gets B; in posting order (the lane), A. Under the lane also through
    P2POp/batch_isend_irecv and blocking send/recv (which would deadlock on tags)."""
    import contextlib

    import torch.distributed as dist

    from nccl_lane import force_tag0
    a, b = torch.randn(5), torch.randn(5)
    dist.broadcast(a, 0)
    dist.broadcast(b, 0)
    got = {}
    with force_tag0() if lane else contextlib.nullcontext():
        bufs = [torch.empty(5), torch.empty(5)]
        if rank == 0:
            ws = [dist.isend(a, 1, tag=1), dist.isend(b, 1, tag=2)]
        else:
            ws = [dist.irecv(bufs[0], 0, tag=2), dist.irecv(bufs[1], 0, tag=1)]
        for w in ws:
            w.wait()
        got["isend"] = bufs
        if lane:
            bufs = [torch.empty(5), torch.empty(5)]
            ops = ([dist.P2POp(dist.isend, a, 1, tag=1), dist.P2POp(dist.isend, b, 1, tag=2)]
                   if rank == 0 else
                   [dist.P2POp(dist.irecv, bufs[0], 0, tag=2),
                    dist.P2POp(dist.irecv, bufs[1], 0, tag=1)])
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            got["batch"] = bufs
            bufs = [torch.empty(5), torch.empty(5)]
            if rank == 0:
                dist.send(a, 1, tag=1)
                dist.send(b, 1, tag=2)
            else:
                dist.recv(bufs[0], 0, tag=2)
                dist.recv(bufs[1], 0, tag=1)
            got["send"] = bufs
    got["restored"] = not getattr(dist.isend, "nccl_lane", False)  # the patch ends with the block
    return a, b, got


def test_nccl_deadlock_sees_a_receive_before_a_send_on_both_sides():
    recv_first = [[("0", 1, "recv", 8, None), ("0", 1, "send", 8, None)],
                  [("0", 0, "recv", 8, None), ("0", 0, "send", 8, None)]]
    assert "would hang" in nccl_deadlock(recv_first)
    batched = [[("0", 1, "recv", 8, 0), ("0", 1, "send", 8, 0)],
               [("0", 0, "send", 8, None), ("0", 0, "recv", 8, None)]]
    assert nccl_deadlock(batched) is None
    assert "bytes" in nccl_deadlock([[("0", 1, "send", 8, None)], [("0", 0, "recv", 4, None)]])
    assert "would hang" in nccl_deadlock([[("0", 1, "send", 8, None)], []])  # never received


def test_lane_pairs_in_posting_order_and_tags_pair_without_it(pool2):
    _, (a, b, by_tag) = pool2.run(_pairing, False)
    assert torch.equal(by_tag["isend"][0], b) and torch.equal(by_tag["isend"][1], a)
    _, (a, b, lane) = pool2.run(_pairing, True)
    assert lane.pop("restored") and set(lane) == {"isend", "batch", "send"}
    for how, (first, second) in lane.items():
        assert torch.equal(first, a) and torch.equal(second, b), how


# -- ring attention ----------------------------------------------------------------------------
RING = [("ring", lay, c) for lay in ("zigzag", "contiguous") for c in (True, False)]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention(request, world):
    pool = request.getfixturevalue(f"pool{world}")
    # ragged: head dim 12, 3 heads, 5 tokens a zigzag chunk
    res = _logged(pool, cp._compare, torch.float32, (2, 3, 10 * world, 12), RING, 7)
    assert all(r == res[0] for r in res)  # every rank measured the same (gathered) tensors
    for case, errs in res[0].items():
        assert max(errs) <= cp.TOL[torch.float32], f"{case}: out/dq/dk/dv errors {errs}"


def _one_head_passes(rank, world, *args):
    """cp._compare with every ring pass one head (messages of at least 1 byte): a pass's last
    dK/dV transfer is in flight while the next pass starts."""
    from pyfast.parallel import ring_attention
    keep, ring_attention.MIN_MESSAGE = ring_attention.MIN_MESSAGE, 1
    try:
        return cp._compare(rank, world, *args)
    finally:
        ring_attention.MIN_MESSAGE = keep


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_head_passes(request, world):
    pool = request.getfixturevalue(f"pool{world}")
    res = _logged(pool, _one_head_passes, torch.float32, (1, 3, 6 * world, 8), RING, 8)
    assert all(r == res[0] for r in res)
    for case, errs in res[0].items():
        assert max(errs) <= cp.TOL[torch.float32], f"{case}: out/dq/dk/dv errors {errs}"


# -- pipeline ----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,v", pp.SCHEDULES)
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_schedules(request, world, schedule, v):
    pool = request.getfixturevalue(f"pool{world}")
    # agreed layout (step 2: first messages in their headers' room), changed (3), agreed (4)
    _logged(pool, pp.check_against_dense, schedule, v, "params", [16, 16, 8, 8])


@pytest.mark.parametrize("schedule,v,case,later", [(s, v, "loss", False) for s, v in pp.SCHEDULES]
                         + [("1f1b", 1, "first", False), ("1f1b", 1, "backward", False),
                            ("1f1b", 1, "first0", True), ("interleaved-1f1b", 2, "loss", True),
                            ("1f1b", 1, "last", False)])
def test_pipeline_failure_reaches_every_rank_and_leaves_no_message_behind(pool4, schedule, v,
                                                                          case, later):
    """pf.failing: a step fails at a micro-batch (in loss_fn, the first stage's forward, a
    middle stage's backward, the root's last backward after it posted the outcome flags'
    receives; later: in the second step, whose headers carry messages); every
    rank raises, naming where it started; then a new Pipeline
    on the same ranks steps, which it cannot when a message of the failed step is left in the
    stream (its receives would pair with it)."""
    for rank, (msg, took) in enumerate(pool4.run(run_tag0, pf.failing, schedule, v, case,
                                                 later=later)):
        assert msg != "no error" and took < pf.HANG_BOUND, (rank, msg, took)
        assert "boom in" in msg, (rank, msg)


# -- async TP ----------------------------------------------------------------------------------
def _async_tp(rank, world):
    """all_gather_linear and linear_reduce_scatter, forward and backward, against tp_comm's
    non-overlapped path (test_async_tp's comparison: bit for bit at 2 ranks)."""
    import torch.nn.functional as F

    from pyfast.parallel import async_tp, tp_comm
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    for pieces in (1, 3):
        x, xf = torch.randn(9, 17, generator=g), torch.randn(9 * world, 17, generator=g)
        w, b = torch.randn(33, 17, generator=g), torch.randn(33, generator=g)
        gy, gz = torch.randn(9 * world, 33, generator=g), torch.randn(9, 33, generator=g)
        out[("agl", pieces)] = atp._compare(
            atp._run(lambda x, w, b: async_tp.all_gather_linear(x, w, b, pieces=pieces),
                     x, w, b, gy),
            atp._run(lambda x, w, b: F.linear(tp_comm.gather_from_sequence_parallel_region(x),
                                              w, b), x, w, b, gy))
        out[("lrs", pieces)] = atp._compare(
            atp._run(lambda x, w, b: async_tp.linear_reduce_scatter(x, w, b, pieces=pieces),
                     xf, w, b, gz),
            atp._run(lambda x, w, b: tp_comm.reduce_scatter_to_sequence_parallel_region(
                F.linear(x, w)) + b, xf, w, b, gz))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_async_tp(request, world):
    pool = request.getfixturevalue(f"pool{world}")
    for rank, res in enumerate(_logged(pool, _async_tp)):
        for (kind, pieces), per in res.items():
            for name, (diff, scale, same) in per.items():
                assert same, (rank, kind, pieces, name)
                # test_async_tp's bounds: bit for bit, except a 4-rank sum, added in another
                # order than gloo's: 2 (W - 1) ulps of the largest magnitude
                summed = (kind, name) in atp.SUMMED and world > 2
                tol = 2 * (world - 1) * atp.EPS[torch.float32] * scale if summed else 0.0
                assert diff <= tol, (rank, kind, pieces, name, diff, tol)


# -- the pipeline's message order, without processes -------------------------------------------
def _sends(acts, pick, q, p, n):
    """{receiving rank: [(kind, boundary, mb)]} that rank q sends running acts, in order."""
    from pyfast.parallel.p2p import ACT, GRAD
    want = {}
    for a in pick(acts):
        if a.kind == "F" and a.stage < n - 1 and (a.stage + 1) % p != q:
            want.setdefault((a.stage + 1) % p, []).append((ACT, a.stage, a.mb))
        elif a.kind in "BI" and a.stage > 0 and (a.stage - 1) % p != q:
            want.setdefault((a.stage - 1) % p, []).append((GRAD, a.stage - 1, a.mb))
    return want


@pytest.mark.parametrize("schedule,v", pp.SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 8)])
def test_pair_orders_hold_every_message_once_in_each_senders_order(schedule, v, p, m):
    from pyfast.parallel import schedules
    from pyfast.parallel.p2p import (ACT, ACT_HEADER, GRAD, GRAD_HEADER, message_orders,
                                     pair_orders)
    if schedule == "interleaved-1f1b" and m % max(1, m // p):
        pytest.skip("m not divisible by its rounds")
    n = p * v
    lists = [schedules.compute_actions(schedule, q, p, m, v) for q in range(p)]
    for training, pick in ((True, list), (False, schedules.forward_only)):
        orders = pair_orders([pick(a) for a in lists], p, n)
        for q, acts in enumerate(lists):  # what q sends, in the order of its own actions
            for dst, msgs in _sends(acts, pick, q, p, n).items():
                got = [msg[1:] for msg in orders[(min(q, dst), max(q, dst))] if msg[0] == q]
                assert [g for g in got if g[0] in (ACT, GRAD)] == msgs, (training, q, dst)
                for kind, head in ((ACT, ACT_HEADER), (GRAD, GRAD_HEADER)):
                    for b in {g[1] for g in msgs if g[0] == kind}:
                        first = next(i for i, g in enumerate(got) if g[:2] == (kind, b))
                        assert got.index((head, b, 0)) < first, (training, q, dst, head, b)
        # nothing else: every activation and gradient once, each pair's entries its own
        total = sum(len(msgs) for q, acts in enumerate(lists)
                    for msgs in _sends(acts, pick, q, p, n).values())
        assert sum(g[1] in (ACT, GRAD) for o in orders.values() for g in o) == total
        assert all(g[0] in pair for pair, o in orders.items() for g in o)
        # each message's place in the step (a failing rank settles its pairs in it): one
        # order over all pairs that each pair's order follows
        orders2, when = message_orders([pick(a) for a in lists], p, n)
        assert orders2 == orders and when.keys() == orders.keys()
        assert all(len(when[k]) == len(orders[k]) and when[k] == sorted(when[k]) for k in when)
        places = [w for k in when for w in when[k]]
        assert sorted(places) == list(range(len(places)))
