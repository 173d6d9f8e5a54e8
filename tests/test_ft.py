"""DataParallel under torchft (pyfast.parallel.ft + ft_reduce) against a real lighthouse.

Replica groups are RankPools of their own (tests/ft_utils.py); the model is gpt-tiny (odd
vocabulary 61, LayerNorm and biases of 64, tied embeddings), the data of replica group g, dp
rank r at committed step s are fixed by (g * world + r, s), as the reference's rank g * world
+ r at step s: a survivor's data do not shift when a group dies.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist

from ft_utils import (coordination_store, equal as _equal, group_env, lighthouse, run_groups,
                      store_port)
from dist_utils import RankError, RankPool

V, T, B, LR, WD = 61, 16, 4, 1e-2, 0.1
SPECS = ("int8", "powersgd:2")  # a dense block quantizer; a stateful per-tensor factorization


def _model(tag: int):
    from pyfast.models import build
    torch.manual_seed(tag)  # every group builds the same model: torchft's init_sync=False
    return build("gpt-tiny", vocab_size=V, seq_len=T, tie_embeddings=True)


def _batch(data_rank: int, step: int, tag: int):
    g = torch.Generator().manual_seed(10_000 * tag + 100 * data_rank + step)
    return (torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))


def _loss(model, x, y):
    out = model(x)
    return torch.nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _memory(dp, staged: bool = False) -> dict:
    """The error-feedback memory (staged: what this step wrote, kept until torchft's verdict:
    comm.guard); none for an exact compressor."""
    fb = getattr(dp.compressor, "feedback", None)
    mem = {} if fb is None else (fb._staged or {}) if staged else fb.memory
    return {k: v.clone() for k, v in mem.items()}


class _Job:
    """One model per spec, each its own DataParallel, AdamW and LR schedule: several reducers
    on one Replicas step together (their commit hooks and heal states side by side)."""

    def __init__(self, replicas=None, group=None, specs=SPECS):
        from pyfast.parallel import DataParallel
        self.parts = []
        for tag, spec in enumerate(specs):
            model = _model(tag)
            dp = DataParallel(model, spec, engine="auto" if replicas else "python",
                              replicas=replicas, group=group)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            self.parts.append((model, dp, opt, sched))
            if replicas is not None:
                replicas.register(f"model{tag}", lambda m=model: {
                    k: v.clone() for k, v in m.state_dict().items()}, model.load_state_dict)
                replicas.register(f"optim{tag}", lambda o=opt: _clone(o.state_dict()),
                                  opt.load_state_dict)
                replicas.register(f"sched{tag}", sched.state_dict, sched.load_state_dict)

    def backward(self, data_rank: int, step: int) -> None:
        for tag, (_, dp, _, _) in enumerate(self.parts):
            _loss(dp, *_batch(data_rank, step, tag)).backward()

    def backward_of(self, data_ranks: list[int], step: int) -> None:
        """The mean over `data_ranks` of their losses' gradients, accumulated (no_sync) and
        then reduced once."""
        for tag, (_, dp, _, _) in enumerate(self.parts):
            for i, d in enumerate(data_ranks):
                with (dp.no_sync() if i < len(data_ranks) - 1 else contextlib.nullcontext()):
                    (_loss(dp, *_batch(d, step, tag)) / len(data_ranks)).backward()

    def step(self) -> None:
        for _, _, opt, sched in self.parts:
            opt.step()
            sched.step()

    def zero_grad(self) -> None:
        for _, _, opt, _ in self.parts:
            opt.zero_grad(set_to_none=True)

    def state(self) -> dict:
        return {"params": [_flat(m) for m, *_ in self.parts],
                "optim": [_clone(o.state_dict()) for _, _, o, _ in self.parts],
                "lr": [s.get_last_lr() for *_, s in self.parts],
                "memory": [_memory(dp) for _, dp, _, _ in self.parts],
                "compressor": [getattr(dp.compressor, "inner", dp.compressor).state_dict()
                               for _, dp, _, _ in self.parts]}

    def close(self) -> None:
        for _, dp, _, _ in self.parts:
            dp.close()


def _clone(x):
    import copy
    return copy.deepcopy(x)


def _plain(rank, world, steps, specs=SPECS, fold=1):
    """The reference: plain DataParallel over `world` gloo ranks, every step; fold: each rank
    computes the mean gradient of `fold` data ranks' batches (rank * fold + i)."""
    job, states = _Job(specs=specs), []
    for s in range(steps):
        job.backward_of([rank * fold + i for i in range(fold)], s)
        job.step()
        job.zero_grad()
        states.append(job.state())
    job.close()
    return states


def _replicas(addr, rid, min_replicas, **kw):
    from pyfast.parallel.ft import Replicas, quiet_torchft
    quiet_torchft()
    return Replicas(addr, rid, min_replicas, timeout=kw.pop("timeout", 10),
                    connect_timeout=5, **kw)


def _replica(rank, world, port, addr, rid, steps, plan):
    """Replica group `rid` (1 dp rank) under torchft. plan: min_replicas, and for the failure
    cases die_at (os._exit after the forward of that step), report_at (an injected error),
    coord (a TCPStore port: the restarted group says "up"; the survivors wait for it after
    their first step without it), joined (stop after that many commits with every group)."""
    group_env(port)
    R = _replicas(addr, rid, plan["min_replicas"])
    job = _Job(R, specs=plan.get("specs", SPECS))
    coord = None
    if plan.get("coord"):
        coord = dist.TCPStore("127.0.0.1", plan["coord"], is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        if plan.get("healing"):
            coord.set("up", "1")
    log, states, started, joined, seen, dropped = [], [], [], 0, False, False
    for i in range(steps):
        R.start()
        started.append(job.state())  # what the quorum (and a heal) left this group with
        data_rank, step = int(rid) * world + rank, R.step
        if i == plan.get("die_at"):
            for _, dp, _, _ in job.parts:
                _loss(dp, *_batch(data_rank, step, 0))
            os._exit(3)  # mid-step: the peers' reductions of this step lose their partner
        job.backward(data_rank, step)
        before = [_memory(dp, staged=True) for _, dp, _, _ in job.parts]
        if i == plan.get("report_at") and rid == "0":
            R.report(RuntimeError("injected failure"))
        ok = R.commit()
        if ok:
            job.step()
        job.zero_grad()
        log.append((step, R.participants, ok))
        states.append({"before": before, **job.state(), "step": R.step})
        if "joined" not in plan:
            continue
        seen = seen or R.participants == 3
        if seen and not dropped and ok and R.participants < 3 and not plan.get("healing"):
            dropped = True  # the first step without the dead group: tell the test, then wait
            coord.set(f"dropped{rid}", "1")  # for the restarted group's word (blocking, no
            coord.wait(["up"])  # sleep): it must find this group still running
        if ok and R.participants == 3 and (dropped or plan.get("healing")):
            joined += 1  # every group counts the same steps: those all three committed
            if joined == plan["joined"]:
                break
    else:
        if "joined" in plan:
            raise RuntimeError(f"group {rid}: the restarted group did not join "
                               f"{plan['joined']} commits within {steps} steps: {log}")
    job.close()
    R.close()
    return {"log": log, "states": states, "started": started}


@pytest.fixture(scope="module")
def groups():
    pools = [RankPool(1) for _ in range(3)]
    yield pools
    for p in pools:
        p.close()


def test_three_groups_equal_plain_dp_step_for_step_and_a_failed_commit_rolls_back(groups):
    """3 groups of 1 rank under torchft == plain DataParallel over 3 gloo ranks, bit for bit
    (parameters, AdamW state, LR, error-feedback memory, PowerSGD's Q): the same collectives
    (on the quorum's gloo group, ranks in replica-id order) summed in the same order, divided
    by the same 3. At step 3 group 0 reports an error: torchft's commit is per replica group,
    so groups 1 and 2 commit it (still the reference's step 3) and group 0 does not: its
    parameters stay and its memory and compressor state are as before the step (rolled back).
    At the next quorum it is behind and heals from a peer: the peer's parameters, optimizer
    state, LR and PowerSGD Q, an empty memory (ft_reduce: a peer's residual is the peer's);
    from then on all three hold the same parameters, optimizer state and LR."""
    steps, bad = 5, 3
    with RankPool(3) as pool:
        ref = pool.run(_plain, bad + 1)
    with lighthouse(3) as addr:
        out = run_groups(groups, _replica, [
            (store_port(p), addr, str(g), steps, {"min_replicas": 3, "report_at": bad})
            for g, p in enumerate(groups)])
    res = [out[g][0] for g in range(3)]
    for g in range(3):
        log, states = res[g]["log"], res[g]["states"]
        assert [n for _, n, _ in log] == [3] * steps, log
        assert [ok for _, _, ok in log] == [True] * bad + [g != 0, True], (g, log)
        for s in range(bad if g == 0 else bad + 1):
            for k in ("params", "optim", "lr", "memory", "compressor"):
                assert _equal(states[s][k], ref[g][s][k]), (g, s, k)
    states, started = res[0]["states"], res[0]["started"]
    # the failed step: nothing moved, the memory and Q are what the step started from
    for k in ("params", "optim", "lr", "memory", "compressor"):
        assert _equal(states[bad][k], states[bad - 1][k]), k
    staged = states[bad]["before"]  # the step had written a new memory, dropped
    assert all(staged) and not any(_equal(staged[i][k], states[bad]["memory"][i][k])
                                   for i in range(2) for k in staged[i])
    # healed at the next quorum from a peer's committed step 4
    peer = res[1]["states"][bad]
    for k in ("params", "optim", "lr", "compressor"):
        assert _equal(started[bad + 1][k], peer[k]), k
    assert started[bad + 1]["memory"] == [{}, {}]
    assert res[0]["log"][bad + 1][0] == res[1]["log"][bad + 1][0] == bad + 1  # torchft's step
    for g in (1, 2):
        for k in ("params", "optim", "lr"):
            assert _equal(res[g]["states"][-1][k], states[-1][k]), (g, k)


def test_two_rank_groups_sum_inside_then_compress_across():
    """2 groups of 2 dp ranks (int8, and none): an exact sum inside each group, the compressor
    across the groups, divided by 2 x 2. The reference is plain DataParallel over 2 ranks, rank
    g computing the mean gradient of group g's two batches: what crosses the groups' link is
    the same sum, halved, and halving is exact in fp32 (a power of two: int8's block scales
    halve, the codes do not change; none's buckets are pre-scaled by 1/2 there), so both give
    the same bits; the error-feedback memory is the reference's times 2 exactly."""
    steps, specs = 3, ("int8", "none")
    with RankPool(2) as pool:
        ref = pool.run(_plain, steps, specs, 2)
    with RankPool(2) as a, RankPool(2) as b, lighthouse(2) as addr:
        out = run_groups([a, b], _replica, [
            (store_port(p), addr, str(g), steps, {"min_replicas": 2, "specs": specs})
            for g, p in enumerate((a, b))])
    for g in range(2):
        for r in range(2):
            res = out[g][r]
            assert [(n, ok) for _, n, ok in res["log"]] == [(2, True)] * steps, res["log"]
            for s in range(steps):
                mine, theirs = res["states"][s], ref[g][s]
                for k in ("params", "optim", "lr"):
                    assert _equal(mine[k], theirs[k]), (g, r, s, k)
                twice = [{k: 2 * v for k, v in m.items()} for m in theirs["memory"]]
                assert _equal(mine["memory"], twice), (g, r, s)


def test_a_group_killed_mid_step_the_others_go_on_and_it_heals():
    """3 groups (int8, powersgd:2), min_replicas 2. Group 2 exits (os._exit) after the forward
    of its third step: the survivors' reductions of that step fail (reported), the step does
    not commit, the next quorum has 2 groups and commits at the same torchft step (no restart,
    the counter goes on). Group 2 restarts under the same replica id, heals from a peer at its
    first quorum (parameters, AdamW state, LR, PowerSGD's Q; an empty memory) and from then on
    holds the survivors' parameters, optimizer state and LR bit for bit. It is restarted once
    both survivors committed a step without it (a TCPStore key each: restarted at once, it
    could rejoin before the lighthouse dropped it), and the survivors then wait for its word
    ("up"), so they are still running when it comes back; every group stops after 2 commits
    with all three."""
    cap = 30
    plan = {"min_replicas": 2, "joined": 2}
    with contextlib.ExitStack() as stack:
        addr = stack.enter_context(lighthouse(2))
        pools = [stack.enter_context(RankPool(1)) for _ in range(3)]
        coord = coordination_store()
        plan["coord"] = coord.port
        for g, p in enumerate(pools):
            p.submit(_replica, store_port(p), addr, str(g), cap,
                     {**plan, **({"die_at": 2} if g == 2 else {})})
        dead = pools[2].wait(60, expect_errors=True)[0]
        assert isinstance(dead, RankError) and dead.kind == "died", dead
        coord.wait(["dropped0", "dropped1"])  # both went on without it: now restart it
        back = stack.enter_context(RankPool(1))
        back.submit(_replica, store_port(back), addr, "2", cap, {**plan, "healing": True})
        res = [p.wait(60)[0] for p in (pools[0], pools[1], back)]
    for g in (0, 1):
        log = res[g]["log"]
        i = next(j for j, (_, n, ok) in enumerate(log) if not ok)  # the step in flight
        assert log[i][1] == 3 and log[i + 1][1:] == (2, True), log
        assert log[i + 1][0] == log[i][0], log  # the same torchft step, committed now
        committed = [st for st, _, ok in log if ok]
        assert committed == list(range(len(committed))), log  # never restarted
    healed, first = res[2]["log"][0], res[2]["started"][0]
    assert healed[1] == 3 and healed[2], res[2]["log"]
    j = [st for st, _, _ in res[0]["log"]].index(healed[0])  # the survivors at that step
    peer = res[0]["started"][j]
    for k in ("params", "optim", "lr", "compressor"):
        assert _equal(first[k], peer[k]), k
    assert first["memory"] == [{}, {}]  # a peer's residual is the peer's (ft_reduce)
    assert res[0]["log"][-1][0] == res[1]["log"][-1][0] == res[2]["log"][-1][0]
    for k in ("params", "optim", "lr", "compressor"):
        assert _equal(res[2]["states"][-1][k], res[0]["states"][-1][k]), k
        assert _equal(res[1]["states"][-1][k], res[0]["states"][-1][k]), k


def _bad_input(rank, world, port, addr, dead_port):
    """What a replica group sees for bad input; each case's (error type, message, seconds)."""
    from pyfast.parallel import DataParallel
    from pyfast.parallel.ft import Replicas, quiet_torchft
    quiet_torchft()
    group_env(port)
    out = {}

    def case(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
            out[name] = ("no error", "", time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = (type(e).__name__, str(e), time.perf_counter() - t0)

    case("unreachable", lambda: Replicas(f"127.0.0.1:{dead_port}", "0", 1))
    R = Replicas(addr, "0", 2, quorum_timeout=3, progress_s=1, connect_timeout=5)
    case("native", lambda: DataParallel(_model(0), "int8", engine="native", replicas=R))
    case("auto", lambda: DataParallel(_model(0), "auto", replicas=R))
    from pyfast.parallel import zero
    for stage in (1, 3):
        case(f"zero{stage}", lambda: zero(_model(0), torch.optim.AdamW, stage=stage, replicas=R))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    logging.getLogger("pyfast.parallel.ft").addHandler(handler)
    case("no quorum", R.start)
    out["progress"] = seen
    R.close()
    return out


def test_bad_input_fails_fast_with_a_clear_error():
    """Lighthouse unreachable: FTError within ~5 s (check_reachable, not torchft's retries);
    min_replicas 2 with one group: FTError after quorum_timeout (3 s), the progress warning
    logged meanwhile; engine='native' and compressor='auto' under torchft, ZeRO stages 1 and
    3 under torchft: FTError."""
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with RankPool(1) as pool, lighthouse(2) as addr:
        out = pool.run(_bad_input, store_port(pool), addr, dead)[0]
    kind, msg, took = out["unreachable"]
    assert kind == "FTError" and "unreachable" in msg and took < 10, out["unreachable"]
    kind, msg, took = out["native"]
    assert kind == "FTError" and "engine='python'" in msg, out["native"]
    kind, msg, _ = out["auto"]
    assert kind == "FTError" and "compressor='auto'" in msg, out["auto"]
    for stage in (1, 3):
        kind, msg, _ = out[f"zero{stage}"]
        assert kind == "FTError" and f"stage {stage} asked" in msg, out[f"zero{stage}"]
    kind, msg, took = out["no quorum"]
    assert kind == "FTError" and "within 3 s" in msg and "2 replica" in msg, out["no quorum"]
    assert 2.5 < took < 30, took  # it waited for quorum_timeout, and no hang
    assert any("waiting for a quorum of 2" in m for m in out["progress"]), out["progress"]
