"""Pipeline on 2 and 4 gloo ranks against a single-process run of the same nn.Sequential: loss
and every parameter gradient within 1e-6 relative (fp32), uneven partitions, batch shapes that
change between steps, inference, traces, and bad input that must fail on every rank with a
message naming the problem (never a hang: the process group times out after 30 s)."""
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn


pytestmark = pytest.mark.dist
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]


def model(seed=0):
    torch.manual_seed(seed)  # 9 layers, so 4 ranks x 2 virtual stages still get one each
    with torch.device("cpu"):  # explicitly: one test runs with the default device set to meta
        return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                             nn.LayerNorm(32), nn.Linear(32, 24), nn.GELU(), nn.Linear(24, 24),
                             nn.Linear(24, 5))


def batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        return torch.randn(rows, 12, generator=g), torch.randn(rows, 5, generator=g)


def _close(got, want, what):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")


def check_against_dense(rank, world, schedule, v, balance, batches, m=4, split_backward=None):
    """Rank job: steps with the given batch sizes; compare with the dense model each time."""
    from pyfast.parallel import Pipeline
    pipe = Pipeline.from_sequential(model(), m, schedule, F.mse_loss, balance=balance,
                                    virtual_stages=v, split_backward=split_backward)
    if split_backward is not None:
        assert all(s == split_backward for s in pipe._split.values()), pipe._split
    first, last = 0 in pipe.stages, pipe.n_stages - 1 in pipe.stages
    ref = model()
    for i, rows in enumerate(batches):
        x, t = batch(rows, seed=i)
        pipe.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = pipe.step(x if first else None, t if last else None)
        ref_loss = F.mse_loss(ref(x), t)
        ref_loss.backward()
        if last:
            _close(loss, ref_loss.detach(), f"loss at step {i}")
        else:
            assert loss is None
        want = dict(ref.named_parameters())
        for stage in pipe.stages.values():
            for name, p in stage.named_parameters():
                _close(p.grad, want[name].grad, f"grad of {name} at step {i} ({rows} rows)")
        y = pipe(x if first else None)
        if last:
            with torch.no_grad():
                _close(y, ref(x), f"inference output at step {i}")
    return sorted(i for s in pipe.stages for i in range(pipe.bounds[s], pipe.bounds[s + 1]))


# Batch sizes change between steps (16, 8, 24 rows): shapes are re-announced each step.
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_two_ranks_equal_single_process(pool2, schedule, v):
    layers = pool2.run(check_against_dense, schedule, v, "params", [16, 8, 24])
    assert sorted(sum(layers, [])) == list(range(9))


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_four_ranks_equal_single_process(pool4, schedule, v):
    layers = pool4.run(check_against_dense, schedule, v, "params", [8, 16])
    assert sorted(sum(layers, [])) == list(range(9))


def ring_of_three(rank, world, m, rows):
    """Interleaved stages on 3 ranks (boundaries 0->1->2->0->...) against the dense model."""
    from pyfast.parallel import Pipeline
    layers = check_against_dense(rank, world, "interleaved-1f1b", 2, "params", rows, m=m)
    line = Pipeline.from_sequential(model(), m, "1f1b", F.mse_loss)
    ring = Pipeline.from_sequential(model(), m, "interleaved-1f1b", F.mse_loss, virtual_stages=2)
    return layers, {q: p.wait_sends for q, p in line.peers.items()}, \
        {q: p.wait_sends for q, p in ring.peers.items()}


# With every send blocking until its receive was posted, these hung (a cycle of waits around
# the ring: rank 0 on 1, 1 on 2, 2 on 0) for m = 3, 5, 6, 8, 12: sends block only on a line.
@pytest.mark.parametrize("m,rows", [(3, [6, 12]), (8, [8, 16])])
def test_three_ranks_with_virtual_stages_do_not_deadlock(m, rows):
    from dist_utils import run_ranks
    out = run_ranks(ring_of_three, 3, m, rows, timeout=90)
    assert sorted(sum((layers for layers, _, _ in out), [])) == list(range(9))
    assert all(all(line.values()) and not any(ring.values()) for _, line, ring in out), out


def test_every_schedule_completes_on_three_ranks():
    from dist_utils import run_ranks
    assert run_ranks(every_schedule_completes, 3, timeout=300) == [[], [], []]


def every_schedule_completes(rank, world):
    """Two steps of every schedule, m in 1..12 and v in 2, 3 for interleaving, each Pipeline
    with a 10 s timeout, so that a cycle of waits fails the case instead of hanging the test."""
    from pyfast.parallel import Pipeline, schedules
    failed = []
    for name in schedules.SCHEDULES:
        for m in (1, 2, 3, 4, 5, 6, 8, 12):
            for v in ((2, 3) if name == "interleaved-1f1b" else (1,)):
                if name == "interleaved-1f1b" and m % max(1, m // world):
                    continue  # refused by the schedule (a multiple of the ranks' share)
                torch.manual_seed(m)
                seq = nn.Sequential(*[nn.Linear(16, 16) for _ in range(world * v)])
                x, t = torch.randn(2 * m, 16), torch.randn(2 * m, 16)
                pipe = Pipeline.from_sequential(seq, m, name, F.mse_loss, virtual_stages=v,
                                                timeout=10)
                last = pipe.n_stages - 1 in pipe.stages
                try:
                    for _ in range(2):
                        loss = pipe.step(x if rank == 0 else None, t if last else None)
                        assert loss is None or torch.isfinite(loss), loss
                except Exception as e:  # noqa: BLE001  (reported with its case)
                    failed.append((name, m, v, f"{type(e).__name__}: {e}"[:200]))
                    dist.barrier()
    return failed


def pooled_receive_buffers(rank, world, schedule, v):
    """Steps of 16 rows (different data each) then 8, 8 micro-batches: each against the dense
    model, while the receive buffers go back to their link's pool once read (Link.recycle), the
    packed sends' once sent, and serve the next step of the same size; a new size replaces
    them."""
    from pyfast.parallel import Pipeline
    pipe = Pipeline.from_sequential(model(), 8, schedule, F.mse_loss, virtual_stages=v)
    first, last = 0 in pipe.stages, pipe.n_stages - 1 in pipe.stages
    ref, pools = model(), []
    for i, rows in enumerate([16, 16, 16, 8]):
        x, t = batch(rows, seed=10 + i)
        pipe.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        pipe.step(x if first else None, t if last else None)
        F.mse_loss(ref(x), t).backward()
        want = dict(ref.named_parameters())
        for stage in pipe.stages.values():
            for name, p in stage.named_parameters():
                _close(p.grad, want[name].grad, f"grad of {name} at step {i} ({rows} rows)")
        assert all(not link.recv_pool.held and not link.send_pool.held
                   for link in pipe.links.values())
        pools.append({(link.stage, way, key[0]): sorted(b.data.data_ptr() for b in bufs)
                      for link in pipe.links.values()
                      for way, pool in (("recv", link.recv_pool), ("send", link.send_pool))
                      for key, bufs in pool.free.items()})
    assert pools[1] and pools[2] == pools[1], pools  # the same buffers, no new ones
    assert not set(pools[3]) & set(pools[2]), pools  # 8 rows: other sizes, the old ones gone
    assert {way for _, way, _ in pools[1]} == {"recv", "send"}, pools
    return max(len(ptrs) for (_, way, _), ptrs in pools[1].items() if way == "recv")


# A received activation's .grad, or a buffer overwritten while in use, would show here as a
# gradient off from the second step on.
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_message_buffers_are_pooled(pool2, schedule, v):
    most = pool2.run(pooled_receive_buffers, schedule, v)
    # gpipe holds every micro-batch's input until its backward: 8 buffers on the last stage;
    # the others recycle within the step, fewer than the 7 a link gets without the pool
    assert max(most) <= 8 and (schedule == "gpipe" or max(most) < 7), most


@pytest.mark.parametrize("split", [True, False])
def test_split_backward_forced_either_way(pool2, split):
    # the model's Linear layers are under the size heuristic: None would fuse
    pool2.run(check_against_dense, "1f1b", 1, "params", [8, 12], split_backward=split)


@pytest.mark.parametrize("schedule,v,balance", [("1f1b", 1, [7, 2]), ("zb-h1", 1, [1, 8]),
                                                ("interleaved-1f1b", 2, [1, 5, 2, 1])])
def test_uneven_partitions(pool2, schedule, v, balance):
    layers = pool2.run(check_against_dense, schedule, v, balance, [12], m=6)
    assert len(layers[0]) == sum(balance[0::2]) and len(layers[1]) == sum(balance[1::2])


def test_more_microbatches_than_ranks_and_fewer(pool4):
    pool4.run(check_against_dense, "1f1b", 1, "params", [4], m=2)    # m < p: no steady state
    pool4.run(check_against_dense, "zb-h1", 1, "params", [36], m=12)


def on_meta_default_device(rank, world, schedule, balance):
    """Every buffer the pipeline allocates must follow its tensors' device: with the default
    device set to meta, one that does not becomes a meta tensor, which gloo cannot send (the
    model and batches are made on the CPU explicitly)."""
    torch.set_default_device("meta")
    try:
        if balance == "time":  # measured on example=, then an all-reduce of the times
            return balanced_by_time(rank, world)
        return check_against_dense(rank, world, schedule, 1, balance, [8, 12])
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("schedule,balance", [("1f1b", "params"), ("zb-h1", "params"),
                                              ("1f1b", "time")])
def test_buffers_follow_the_tensors_device(pool2, schedule, balance):
    pool2.run(on_meta_default_device, schedule, balance)


def tuple_stages(rank, world, schedule, balance, tuple_out):
    """Stages passing tuples (float, float, int64, an unused float) or (float, float) across
    the boundary, and x.requires_grad, against the dense model."""
    from test_pipeline_schedules import tuple_loss, tuple_model
    from pyfast.parallel import Pipeline
    g = torch.Generator().manual_seed(11)
    x0, t = torch.randn(16, 10, generator=g, requires_grad=True), torch.randn(16, 4, generator=g)
    ref = tuple_model(tuple_out=tuple_out)
    tuple_loss(ref(torch.tanh(x0)), t).backward()
    want_x = x0.grad.clone()
    x0.grad = None
    pipe = Pipeline.from_sequential(tuple_model(tuple_out=tuple_out), 4, schedule, tuple_loss,
                                    balance=balance, split_backward=True)
    first, last = rank == 0, rank == world - 1
    pipe.step(torch.tanh(x0) if first else None, t if last else None)
    want = dict(ref.named_parameters())
    for name, p in pipe.module.named_parameters():
        _close(p.grad, want[name].grad, f"grad of {name}")
    if first:
        _close(x0.grad, want_x, "x's gradient")
    y = pipe(torch.tanh(x0).detach() if first else None)
    if last:
        with torch.no_grad():
            want_y = ref(torch.tanh(x0))
        for got, w in zip(y if tuple_out else [y], want_y if tuple_out else [want_y]):
            _close(got, w, "inference output")
    return True


@pytest.mark.parametrize("schedule,balance,tuple_out", [
    ("1f1b", [2, 3], False),   # Fork's 4-tuple (with an int64 and an unused tensor) crosses
    ("zb-h1", [3, 2], False),  # Mix's pair crosses
    ("gpipe", [2, 3], True),   # and the last stage returns a tuple
])
def test_tuple_stages_and_input_gradient(pool2, schedule, balance, tuple_out):
    pool2.run(tuple_stages, schedule, balance, tuple_out)


def balanced_by_time(rank, world):
    from pyfast.parallel import Pipeline
    x, _ = batch(16, 0)
    pipe = Pipeline.from_sequential(model(), 4, "1f1b", F.mse_loss, balance="time", example=x)
    counts = [b - a for a, b in zip(pipe.bounds, pipe.bounds[1:])]
    return [pipe.bounds, check_against_dense(rank, world, "1f1b", 1, counts, [16])]


def test_balance_by_time(pool2):
    (b0, _), (b1, _) = pool2.run(balanced_by_time)
    assert b0 == b1, "every rank must compute the same partition"


def traced(rank, world, path):
    from pyfast.parallel import Pipeline, save_trace
    pipe = Pipeline.from_sequential(model(), 4, "zb-h1", F.mse_loss)
    x, t = batch(8, 0)
    pipe.step(x if rank == 0 else None, t if rank == world - 1 else None, trace=True)
    return save_trace(path), pipe.last_stats


def test_trace(pool2, tmp_path):
    path = str(tmp_path / "pp.json")
    (written, stats), (other, _) = pool2.run(traced, path)
    assert written == path and other is None
    events = json.load(open(path))["traceEvents"]
    kinds = {(e["pid"], e["cat"]) for e in events if e["ph"] == "X"}
    assert {(0, "forward"), (0, "weight-grad"), (1, "backward"), (1, "send"), (0, "recv")} <= kinds
    assert os.path.getsize(str(tmp_path / "pp.png")) > 1000
    assert stats["peak_activation_bytes"] > 0 and stats["wall"] >= stats["compute"]


def agreed_layouts(rank, world):
    """Per call (step or forward), the messages this rank sent its peer, and whether the
    results equal the dense model's (loss and gradients within 1e-6; outputs for forward)."""
    from pyfast.parallel import Pipeline
    pipe = Pipeline.from_sequential(model(), 4, "1f1b", F.mse_loss)
    ref = model()
    (peer,) = pipe.peers.values()
    out = []
    for i, (call, rows) in enumerate([("step", 8), ("step", 8), ("step", 12), ("step", 12),
                                      ("forward", 12), ("step", 12), ("step", 12)]):
        x, t = batch(rows, seed=i)
        if call == "forward":
            y = pipe.forward(x if rank == 0 else None)
            if rank == world - 1:
                _close(y, ref(x).detach(), f"forward output at call {i}")
        else:
            pipe.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            loss = pipe.step(x if rank == 0 else None, t if rank == world - 1 else None)
            want = F.mse_loss(ref(x), t)
            want.backward()
            if rank == world - 1:
                _close(loss, want.detach(), f"loss at call {i}")
            named = dict(ref.named_parameters())
            for stage in pipe.stages.values():
                for name, p in stage.named_parameters():
                    _close(p.grad, named[name].grad, f"grad of {name} at call {i}")
        out.append(len(peer.sent))
    return out


def test_layouts_are_agreed_once_and_may_change(pool2):
    """From the second call on, each boundary's first message of a direction rides in its
    header (4 micro-batches: 4 messages a direction, not 5) while the layout is the last call's;
    a new batch size, or gradients after a forward() (which sends none), go as before: a header,
    then the message. Every call's results equal the dense model's."""
    sent0, sent1 = pool2.run(agreed_layouts)
    #       rows 8: first, agreed   12: changed, agreed   forward   grads after it   agreed
    assert sent0 == [5, 4, 5, 4, 4, 4, 4], sent0  # activations
    assert sent1 == [5, 4, 5, 4, 0, 5, 4], sent1  # gradients


def io_threads(rank, world):
    """The threads and groups of a Pipeline built with io_nice=7 and with None."""
    import torch.distributed as dist

    from pyfast.comm.threads import LOOP_NAME, loop_threads
    from pyfast.parallel import Pipeline
    main = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = Pipeline.from_sequential(model(), 2, "1f1b", F.mse_loss, io_nice=7)
    kept = Pipeline.from_sequential(model(), 2, "1f1b", F.mse_loss, io_nice=None)
    x, t = batch(8, 0)
    for pipe in (lowered, kept):  # both still train: the batch threads run
        pipe.step(x if rank == 0 else None, t if rank == world - 1 else None)
    names = {tid: open(f"/proc/self/task/{tid}/comm").read().strip() for tid in lowered.io_threads}
    return {"nice": [os.getpriority(os.PRIO_PROCESS, tid) for tid in lowered.io_threads],
            "names": sorted(set(names.values())), "loops": len(loop_threads()),
            "private": lowered.group is not dist.group.WORLD,
            "flags_private": lowered.flags.group not in (dist.group.WORLD, lowered.group),
            "policy": {os.sched_getscheduler(tid) for tid in lowered.io_threads},
            "waits": ({peer.wait_sends for peer in lowered.peers.values()},
                      {peer.wait_sends for peer in kept.peers.values()}),
            "main": (main, os.getpriority(os.PRIO_PROCESS, 0)),
            "kept": (kept.group is dist.group.WORLD, kept.io_threads), "loop": LOOP_NAME,
            "policies": (os.SCHED_BATCH, os.sched_getscheduler(0))}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names come from /proc")
def test_gloo_io_threads_of_the_pipeline_groups_are_lowered(pool2):
    """io_nice: the pipeline's two private gloo groups (messages, outcome flags) have their I/O
    loop thread at SCHED_BATCH and that nice value, the main thread keeps its policy and
    priority; io_nice=None leaves the given group and every thread as they were."""
    for got in pool2.run(io_threads):
        batch, main_policy = got["policies"]
        assert len(got["nice"]) == 2 and set(got["nice"]) == {7}, got
        assert got["policy"] == {batch} and main_policy != batch, got
        assert got["names"] == [got["loop"]] and got["loops"] >= 3, got  # + the default group's
        assert got["private"] and got["flags_private"], got
        assert got["waits"] == ({True}, {False}), got  # each send waited where lowered
        assert got["main"][0] == got["main"][1] < 7, got
        assert got["kept"] == (True, []), got


# -- bad input: every rank raises, naming the problem --------------------------------------------
def bad(rank, world, case):
    from pyfast.parallel import Pipeline
    x, t = batch(10, 0)
    if case == "indivisible":
        pipe = Pipeline.from_sequential(model(), 4, "1f1b", F.mse_loss)
        pipe.step(x if rank == 0 else None, t if rank == world - 1 else None)
    elif case == "target-rows":
        pipe = Pipeline.from_sequential(model(), 2, "gpipe", F.mse_loss)
        pipe.step(x if rank == 0 else None, t[:8] if rank == world - 1 else None)
    elif case == "shape":  # stage 1 starts with Linear(24, 5) but stage 0 ends with 32 features
        seq = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(24, 5))
        pipe = Pipeline.from_sequential(seq, 2, "1f1b", F.mse_loss, balance=[2, 1])
        pipe.step(x if rank == 0 else None, t if rank == world - 1 else None)
    elif case == "no-loss":  # only the last rank forgets it
        Pipeline.from_sequential(model(), 2, loss_fn=F.mse_loss if rank == 0 else None)
    elif case == "world":
        Pipeline.from_sequential(model(), 2, loss_fn=F.mse_loss, balance=[3, 3, 3])
    elif case == "layers":
        Pipeline.from_sequential(nn.Sequential(nn.Linear(12, 5)), 2, loss_fn=F.mse_loss)
    elif case == "io-nice":  # the same bad value everywhere: each rank names it
        Pipeline.from_sequential(model(), 2, loss_fn=F.mse_loss, io_nice=-5)
    elif case == "io-nice-differs":
        Pipeline.from_sequential(model(), 2, loss_fn=F.mse_loss, io_nice=19 if rank else None)
    return "no error"


@pytest.mark.parametrize("case,message", [
    ("indivisible", "batch size 10 is not divisible by n_microbatches=4"),  # x and target alike
    ("target-rows", "x and target batch sizes differ"),
    ("shape", r"stage 1 \(layers 2..2\) cannot take stage 0's output"),
])
def test_bad_step_fails_on_every_rank(pool2, case, message):
    # the failed step's messages left in flight carry that Pipeline's tags, which no later
    # Pipeline matches, and its agreement completed: the ranks can go on with a new one
    _expect_everywhere(pool2.run(bad, case, expect_errors=True, timeout=60), message)


@pytest.mark.parametrize("case,message", [
    ("no-loss", "loss_fn is missing on the last stage"),
    ("world", "balance lists 3 stages but the group has 2 ranks"),
    ("layers", "more stages than layers"),
    ("io-nice", r"io_nice must be None or an int in 0..19 \(a nice value for gloo's I/O thread\), "
                "got -5"),
    ("io-nice-differs", "ranks disagree on the pipeline"),
])
def test_bad_construction_fails_on_every_rank(pool2, case, message):
    _expect_everywhere(pool2.run(bad, case, expect_errors=True, timeout=60), message)


class _SavedBytes:
    """Bytes of the activations the autograd graph holds, measured: every tensor saved for the
    backward (one count per memory region, so a tensor saved twice counts once; a micro-batch
    is its own region of the batch; parameters excluded) is live from its save until autograd
    frees it (the saved variable's holder is garbage). `peak` is the most held at once."""

    class _Held:
        __slots__ = ("t", "__weakref__")

    def __init__(self, params):
        import weakref
        self.weakref, self.skip = weakref, {p.untyped_storage().data_ptr() for p in params}
        self.refs, self.live, self.peak = {}, 0, 0

    def _drop(self, region):
        n = self.refs[region]
        if n == 1:
            del self.refs[region]
            self.live -= region[1]
        else:
            self.refs[region] = n - 1

    def pack(self, t):
        h, region = self._Held(), (t.data_ptr(), t.nbytes)
        h.t = t.detach()  # a saved output keeps no grad_fn: no cycle through its own node
        if t.untyped_storage().data_ptr() not in self.skip:
            n = self.refs.get(region, 0)
            self.live += region[1] * (n == 0)
            self.peak = max(self.peak, self.live)
            self.refs[region] = n + 1
            self.weakref.finalize(h, self._drop, region)
        return h

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda h: h.t)


def held_activations(rank, world):
    """Per schedule: (measured peak of activation bytes during a step of 4 micro-batches, one
    micro-batch's bytes, what the action list claims this rank holds at most)."""
    import gc

    from pyfast.parallel import Pipeline
    from pyfast.parallel import schedules
    m, rows = 4, 8
    out = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        peaks = []
        for n_mb in (1, m):  # one micro-batch alone, then the step
            pipe = Pipeline.from_sequential(model(), n_mb, schedule, F.mse_loss)
            x, t = batch(rows * n_mb, 0)
            saved = _SavedBytes(pipe.parameters())
            gc.disable()  # holders die by refcount, when autograd frees them; no later sweep
            try:
                with saved.hooks():
                    pipe.step(x if rank == 0 else None, t if rank == world - 1 else None)
            finally:
                gc.enable()
            gc.collect()
            peaks.append(saved.peak)
            left = saved.live  # reported, not asserted here: a rank must not fail alone
        counted = schedules.held(schedules.compute_actions(schedule, rank, world, m))
        out[schedule] = (peaks[1], peaks[0], counted, left)
    return out


def test_activation_memory_is_what_the_schedule_claims(pool2):
    """Measured, not counted from the action list: GPipe holds all m micro-batches' activations,
    1F1B at most p - rank of them (2 and 1 here), ZB-H1 no more than 1F1B's peak."""
    for rank, got in enumerate(pool2.run(held_activations)):
        for schedule, (peak, one, claim, left) in got.items():
            assert one > 0 and left == 0, (rank, schedule, one, left)
            if schedule == "zb-h1":  # held until W, but after I only W's inputs stay
                assert peak <= claim * one, (rank, schedule, peak, one, claim)
            else:
                assert peak == claim * one, (rank, schedule, peak, one, claim)
        assert got["1f1b"][2] == 2 - rank and got["gpipe"][2] == 4
        assert got["1f1b"][0] < got["gpipe"][0]


def _expect_everywhere(results, message):
    for rank, r in enumerate(results):
        assert r != "no error", f"rank {rank} did not fail"
        assert re.search(message, r.message), f"rank {rank}: {r.message}"


def held_sends(rank, world, schedule, m, io_nice):
    """Most send buffers this rank's links hold after any action of a step, and how many they
    hold once the step returned."""
    from pyfast.parallel import Pipeline
    pipe = Pipeline.from_sequential(model(), m, schedule, F.mse_loss, io_nice=io_nice)
    x, t = batch(2 * m, 0)
    peak, act = [0], pipe._act

    def counted(a):
        act(a)
        peak[0] = max(peak[0], sum(len(link.sends) for link in pipe.links.values()))
    pipe._act = counted
    pipe.step(x if rank == 0 else None, t if rank == world - 1 else None)
    return peak[0], sum(len(link.sends) for link in pipe.links.values())


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_sent_buffers_are_released_when_their_receive_was_posted(pool2, schedule):
    """io_nice=None (sends not waited as made): a send is waited (and its packed buffer
    dropped) as soon as a later message from the peer arrives, which the peer sent only after
    posting that send's receive: with 8 micro-batches each rank holds at most 3 (2 payloads
    and the step's 1 KB header; measured before this: rank 1 held all 8 gradients it sent back
    and the header until the step ended), none after the step. With io_nice (the default on
    gloo) each send is waited as it is made: none is ever held."""
    (peak0, left0), (peak1, left1) = pool2.run(held_sends, schedule, 8, None)
    assert left0 == left1 == 0
    assert 1 <= peak0 <= 3 and 1 <= peak1 <= 3, (peak0, peak1)
    assert pool2.run(held_sends, schedule, 8, 19) == [(0, 0), (0, 0)]


def early_flags(rank, world, schedule, v):
    """Where the step posts the outcome flags' receives (the compute actions run before it, -1:
    never), this rank's compute actions, and whether a peer's flag landed in the root's posted
    receive before the root's exchange."""
    import time

    import torch.distributed as dist

    from pyfast.parallel import Pipeline, schedules
    from pyfast.parallel.outcome import Flags
    pipe = Pipeline.from_sequential(model(), 8, schedule, F.mse_loss, virtual_stages=v)
    done, posted, act, post = [0], [], pipe._act, pipe.flags.post_early
    pipe.flags.post_early = lambda dev: (posted.append(done[0]), post(dev))
    pipe._act = lambda a: (act(a), done.__setitem__(0, done[0] + (a.kind in schedules.COMPUTE)))
    x, t = batch(16, 0)
    pipe.step(x if rank == 0 else None, t if rank == world - 1 else None)
    n_compute = sum(a.kind in schedules.COMPUTE for a in pipe.actions)
    # the Flags alone: rank 1's flag (1: failed) sits in the root's buffer before its exchange
    flags = Flags(dist.new_group(list(range(world))), rank, world, {True: 0, False: 0})
    flags.begin(torch.device("cpu"))
    if rank != 0:
        return posted, n_compute, None, flags.exchange(True, torch.device("cpu"))
    flags.post_early(torch.device("cpu"))
    buf, deadline = flags._early[1][1], time.monotonic() + 10
    while buf.item() == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    landed = buf.item()
    return posted, n_compute, landed, flags.exchange(False, torch.device("cpu"))


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_the_roots_flag_receives_are_posted_before_its_last_actions(pool2, schedule, v):
    """The rank that finishes last (rank 0 here) posts the flags' receives before its
    pipeline.EARLY-th last compute action, once a step; the others never: gloo moves a
    message only once its receive is posted, so the flags travel while the root computes."""
    from pyfast.parallel.pipeline import EARLY
    (posted0, n0, landed, out0), (posted1, _, _, out1) = pool2.run(early_flags, schedule, v)
    assert posted0 == [n0 - EARLY] and posted1 == []
    assert landed == 1 and out0 is True and out1 is True
