"""Pipeline pieces that need no processes: schedule orders, their lowering to transfers, the
partitioner, the zero-bubble backward split, headers, and a one-rank Pipeline against the
dense model."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyfast.parallel import Pipeline
from pyfast.parallel import schedules
from pyfast.parallel.p2p import (failed_message, pack, pack_header, read_failure, spec_of, unpack,
                                 unpack_header)
from pyfast.parallel.zero_bubble import _linear_weight_grad, input_grad, weight_grad
from pyfast.parallel.schedules import partition

CASES = [(name, p, m, v) for name in schedules.SCHEDULES for p in (1, 2, 3, 4)
         for m in (1, 2, 3, 4, 8, 12)
         for v in ((2, 3) if name == "interleaved-1f1b" else (1,))
         if not (name == "interleaved-1f1b" and m % max(1, m // p))]


def orders(name, p, m, v):
    return [schedules.compute_actions(name, r, p, m, v) for r in range(p)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_microbatch_once_in_dependency_order(name, p, m, v):
    for rank, acts in enumerate(orders(name, p, m, v)):
        assert all(a.stage % p == rank for a in acts)
        pos = {(a.kind, a.mb, a.stage): i for i, a in enumerate(acts)}
        assert len(pos) == len(acts), "an action repeats"
        for s in range(rank, p * v, p):
            for k in range(m):
                f = pos.pop((schedules.F, k, s))
                if (schedules.B, k, s) in pos:
                    assert f < pos.pop((schedules.B, k, s))
                else:
                    i, w = pos.pop((schedules.I, k, s)), pos.pop((schedules.W, k, s))
                    assert f < i < w
        assert not pos, f"unexpected actions {pos}"


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_no_deadlock_and_bubble(name, p, m, v):
    res = schedules.simulate(orders(name, p, m, v), p * v,
                             cost={schedules.F: 1 / v, schedules.B: 2 / v, schedules.I: 1 / v,
                                   schedules.W: 1 / v})
    formula = (p - 1) / (m + p - 1)
    if name in ("gpipe", "1f1b"):
        assert res["bubble"] == pytest.approx(formula)
    elif p > 1 and m >= p:  # zero bubble and interleaving only shrink it
        assert res["bubble"] < formula


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (3, 5)])
def test_memory_bounds(p, m):
    for r in range(p):
        assert schedules.held(schedules.one_f_one_b(r, p, m)) == min(p - r, m)  # at most p in flight
        assert schedules.held(schedules.zb_h1(r, p, m)) <= p  # 1F1B's peak, as the paper says
        assert schedules.held(schedules.gpipe(r, p, m)) == m


def test_zero_bubble_cuts_the_bubble_to_a_third():
    # Qi et al. 2023: 1F1B idles (p-1)(F+B+W); ZB-H1 (p-1)(F+B-W), with F = B = W
    for p, m in [(2, 8), (4, 8), (4, 24)]:
        one = schedules.simulate(orders("1f1b", p, m, 1), p)
        zb = schedules.simulate(orders("zb-h1", p, m, 1), p)
        assert one["end"] - 3 * m == 3 * (p - 1)
        assert zb["end"] - 3 * m == pytest.approx(p - 1)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_lowered_transfers_pair_up(name, p, m, v):
    n = p * v
    lowered = [schedules.lower(acts, n) for acts in orders(name, p, m, v)]
    sends, recvs = set(), set()
    for acts in lowered:
        seen = set()
        for a in acts:
            if a.kind in (schedules.SEND_F, schedules.SEND_B):
                producer = schedules.F if a.kind == schedules.SEND_F else None
                assert (producer, a.mb, a.stage) in seen or any(
                    (k, a.mb, a.stage) in seen
                    for k in (schedules.B, schedules.I)), f"{a} before its producer"
                sends.add((a.kind[-1], a.mb, a.stage + (1 if a.kind == schedules.SEND_F else -1)))
            elif a.kind in (schedules.RECV_F, schedules.RECV_B):
                recvs.add((a.kind[-1], a.mb, a.stage))
            seen.add((a.kind, a.mb, a.stage))
        for i, a in enumerate(acts):  # each receive is posted before the action that consumes it
            if a.kind == schedules.F and a.stage > 0:
                assert schedules.Action(schedules.RECV_F, a.mb, a.stage) in acts[:i]
            if a.kind in (schedules.B, schedules.I) and a.stage < n - 1:
                assert schedules.Action(schedules.RECV_B, a.mb, a.stage) in acts[:i]
    assert sends == recvs


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="unknown schedule"):
        schedules.compute_actions("pipedream", 0, 2, 4)
    with pytest.raises(ValueError, match="virtual_stages=2 needs"):
        schedules.compute_actions("1f1b", 0, 2, 4, 2)
    with pytest.raises(ValueError, match="divisible"):
        schedules.compute_actions("interleaved-1f1b", 0, 4, 9, 2)


def test_partition():
    pairs = [1000, 0] * 8  # 8 x (Linear + ReLU): split between pairs, never inside one
    assert partition(pairs, 2) == [8, 8]
    assert partition(pairs, 4) == [4, 4, 4, 4]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert partition([1, 1, 1], 3) == [1, 1, 1]
    assert partition([0.2, 0.1, 0.1, 0.3, 0.3], 2) == [3, 2]


def _stage_models():
    lin = nn.Linear(6, 6)
    return {
        "linear-relu": nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6)),
        "inplace": nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 6, bias=False)),
        "norm-gelu": nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6), nn.GELU(), nn.LayerNorm(6)),
        "conv": nn.Sequential(nn.Unflatten(1, (1, 6)), nn.Conv1d(1, 2, 3), nn.Tanh(), nn.Flatten()),
        "tied": nn.Sequential(lin, nn.Tanh(), lin),
    }


@pytest.mark.parametrize("kind", list(_stage_models()))
def test_split_backward_equals_full_backward(kind):
    seq = _stage_models()[kind]
    x = torch.randn(5, 6).requires_grad_()
    y = seq(x)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, [x, *seq.parameters()], dy, retain_graph=True)
    params = list(seq.parameters())
    split = input_grad(y, dy, x, params)
    if kind == "tied":
        assert split is None  # W from each use would count the other's share: full backward
        return
    plan, gx = split
    torch.testing.assert_close(gx, want[0], rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in params), "I must not touch weight gradients"
    if kind == "linear-relu":  # the in-place GEMM path, not autograd, takes F.linear's pattern
        assert [_linear_weight_grad(n, g, ps) for n, g, ps in plan] == [True, True]
        for p in params:
            p.grad = None
    weight_grad(plan)
    for p, g in zip(params, want[1:]):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)


def test_header_round_trip():
    spec = (True, (((3, 5, 7), torch.bfloat16, True), ((3,), torch.int64, False), ((), torch.bool, False)))
    h = unpack_header(pack_header(12, True, spec))
    assert (h["spec"], h["step"], h["training"], h["error"]) == (spec, 12, True, None)
    err = unpack_header(pack_header(3, False, error="batch size 30 is bad"))
    assert err["error"] == "batch size 30 is bad" and err["spec"] == (False, ())


def test_packed_messages_round_trip():
    ts = [torch.randn(3, 5).to(torch.bfloat16), torch.randint(-9, 9, (7,)), torch.rand(2, 3) > 0.5,
          torch.randn(1, 3, dtype=torch.float64), torch.randn(0, 4)]
    specs = spec_of(True, ts)[1]
    buf = pack(ts, specs, ts[0].device)
    assert read_failure(buf) is None
    for got, want in zip(unpack(buf, specs), ts):
        assert got.dtype == want.dtype and torch.equal(got, want)
    bad = failed_message(specs, "rank 3: loss_fn failed", ts[0].device)
    assert bad.shape == buf.shape and read_failure(bad) == "rank 3: loss_fn failed"
    tiny = failed_message([((1,), torch.float32, True)], "rank 3: loss_fn failed", ts[0].device)
    assert tiny.numel() == 17 and read_failure(tiny) == "rank 3: loss_f"  # as much as fits


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.LayerNorm(16), nn.Linear(16, 4))


@pytest.mark.parametrize("schedule", list(schedules.SCHEDULES))
def test_one_rank_equals_dense(schedule):
    x, t = torch.randn(12, 10), torch.randn(12, 4)
    ref = _model()
    ref_loss = F.mse_loss(ref(x), t)
    ref_loss.backward()
    v = 3 if schedule == "interleaved-1f1b" else 1
    pipe = Pipeline.from_sequential(_model(), 4, schedule, F.mse_loss, virtual_stages=v)
    loss = pipe.step(x, t)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    want = dict(ref.named_parameters())
    for stage in pipe.stages.values():
        for name, p in stage.named_parameters():
            g = want[name].grad
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6 * g.abs().max().item())
    want_y = ref(x)  # 3-row and 12-row GEMMs round differently: compare at 1e-6 of the scale
    torch.testing.assert_close(pipe(x), want_y, rtol=1e-6, atol=1e-6 * want_y.abs().max().item())


def test_one_rank_bad_input():
    with pytest.raises(ValueError, match="more stages than layers"):
        Pipeline.from_sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 2, "interleaved-1f1b",
                                 F.mse_loss, virtual_stages=3)
    with pytest.raises(ValueError, match="loss_fn is missing on the last stage"):
        Pipeline.from_sequential(_model(), 2)
    with pytest.raises(ValueError, match="balance lists 2 stages but the group has 1 ranks"):
        Pipeline.from_sequential(_model(), 2, loss_fn=F.mse_loss, balance=[3, 3])
    pipe = Pipeline.from_sequential(_model(), 4, loss_fn=F.mse_loss)
    with pytest.raises(Exception, match="batch size 10 is not divisible by n_microbatches=4"):
        pipe.step(torch.randn(10, 10), torch.randn(10, 4))


# -- stages returning tuples; the first stage's input gradient -------------------------------------
class Fork(nn.Module):
    """h -> (h, tanh(h), a count that needs no gradient, a tensor nobody downstream uses)."""

    def forward(self, h):
        return h, torch.tanh(h), (h > 0).sum(-1), h * 3


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, t):
        h, g, n, _ = t
        return h + g * (1 + n.unsqueeze(-1) / 16), self.lin(g)


class Join(nn.Module):
    def __init__(self, out=4):
        super().__init__()
        self.lin = nn.Linear(16, out)

    def forward(self, t):
        a, b = t
        return self.lin(a * b)


def tuple_model(seed=5, tuple_out=False):
    torch.manual_seed(seed)
    # with tuple_out the last stage returns Mix's tuple: (logits, a second output)
    return nn.Sequential(nn.Linear(10, 16), Fork(), Mix(), nn.Identity(),
                         nn.Identity() if tuple_out else Join())


def tuple_loss(y, t):
    if isinstance(y, tuple):
        return F.mse_loss(y[0][:, :4], t) + y[1].square().mean()
    return F.mse_loss(y, t)


@pytest.mark.parametrize("schedule", list(schedules.SCHEDULES))
@pytest.mark.parametrize("tuple_out", [False, True])
def test_one_rank_tuple_stages_equal_dense(schedule, tuple_out):
    x, t = torch.randn(12, 10), torch.randn(12, 4)
    ref = tuple_model(tuple_out=tuple_out)
    ref_loss = tuple_loss(ref(x), t)
    ref_loss.backward()
    v = 5 if schedule == "interleaved-1f1b" else 1  # every layer its own stage: tuples cross
    pipe = Pipeline.from_sequential(tuple_model(tuple_out=tuple_out), 4, schedule, tuple_loss,
                                    virtual_stages=v)
    torch.testing.assert_close(pipe.step(x, t), ref_loss, rtol=1e-6, atol=0)
    want = dict(ref.named_parameters())
    for stage in pipe.stages.values():
        for name, p in stage.named_parameters():
            g = want[name].grad
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6 * g.abs().max().item())
    y, want_y = pipe(x), ref(x)
    for got, w in zip(y if tuple_out else [y], want_y if tuple_out else [want_y]):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6 * w.abs().max().item())


def _wide(seed=4):  # Linear(512, 512) reaches the split-backward size heuristic (2^18 weights)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))


@pytest.mark.parametrize("split", [None, True, False])
@pytest.mark.parametrize("leaf", [True, False])
def test_input_gradient_follows_requires_grad(split, leaf):
    """x.requires_grad, not the size heuristic behind split_backward, decides whether x gets a
    gradient; a non-leaf x passes it on into its own graph (once, like loss.backward())."""
    x0, t = torch.randn(8, 8, requires_grad=True), torch.randn(8, 3)
    ref = _wide()
    x = x0 if leaf else torch.tanh(x0)
    F.mse_loss(ref(x), t).backward()
    want = x0.grad.clone()
    x0.grad = None
    pipe = Pipeline.from_sequential(_wide(), 4, "1f1b", F.mse_loss, split_backward=split)
    x = x0 if leaf else torch.tanh(x0)
    pipe.step(x, t)
    assert x0.grad is not None, "x.requires_grad but x got no gradient"
    torch.testing.assert_close(x0.grad, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    x1 = torch.randn(8, 8)
    pipe.step(x1, t)  # no requires_grad: no gradient, and none asked of autograd
    assert x1.grad is None


def test_trace_files_are_written_atomically(tmp_path, monkeypatch):
    """A failure while writing leaves the earlier trace whole and no temporary file behind."""
    import json
    import os
    from pyfast.parallel import trace
    pipe = Pipeline.from_sequential(_model(), 2, "1f1b", F.mse_loss)
    pipe.step(torch.randn(4, 10), torch.randn(4, 4), trace=True)
    path = str(tmp_path / "t.json")
    assert trace.save_trace(path) == path
    before = {p: open(tmp_path / p, "rb").read() for p in ("t.json", "t.png")}
    assert json.loads(before["t.json"])["traceEvents"]

    def half_then_fail(obj, f, **kw):
        f.write('{"traceEvents": [')
        raise OSError("disk full")
    monkeypatch.setattr(trace.json, "dump", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        trace.save_trace(path)
    monkeypatch.undo()

    def png_fails(self, f, **kw):
        f.write(b"\x89PNG half")
        raise OSError("disk full")
    import matplotlib.figure
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", png_fails)
    with pytest.raises(OSError, match="disk full"):
        trace.plot([[("forward", "F0 s0", 0.0, 1e-3)]], str(tmp_path / "t.png"))
    assert {p: open(tmp_path / p, "rb").read() for p in ("t.json", "t.png")} == before
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.png"]
