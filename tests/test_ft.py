"""DataParallel under torchft (pyfast.parallel.ft + ft_reduce) against a real lighthouse.

Replica groups are RankPools of their own (tests/ft_utils.py); the model is gpt-tiny (odd
vocabulary 61, LayerNorm and biases of 64, tied embeddings), the data of replica group g, dp
rank r at committed step s are fixed by (g * world + r, s), as the reference's rank g * world
+ r at step s: a survivor's data do not shift when a group dies.
"""
from __future__ import annotations

import datetime
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist

from ft_utils import (coordination_store, group_env, lighthouse, run_groups, store_port)
from dist_utils import RankPool

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


def _memory(dp) -> dict:
    return {k: v.clone() for k, v in dp.compressor.feedback.memory.items()}


class _Job:
    """One model per spec, each its own DataParallel, AdamW and LR schedule: several reducers
    on one Replicas step together (their commit hooks and heal states side by side)."""

    def __init__(self, replicas=None, group=None):
        from pyfast.parallel import DataParallel
        self.parts = []
        for tag, spec in enumerate(SPECS):
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
                "compressor": [dp.compressor.inner.state_dict() for _, dp, _, _ in self.parts]}

    def close(self) -> None:
        for _, dp, _, _ in self.parts:
            dp.close()


def _clone(x):
    import copy
    return copy.deepcopy(x)


def _plain(rank, world, steps):
    """The reference: plain DataParallel over `world` gloo ranks, every step."""
    job, states = _Job(), []
    for s in range(steps):
        job.backward(rank, s)
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
    job = _Job(R)
    coord = None
    if plan.get("coord"):
        coord = dist.TCPStore("127.0.0.1", plan["coord"], is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        if plan.get("healing"):
            coord.set("up", "1")
    log, states, started, joined, dropped = [], [], [], 0, False
    for i in range(steps):
        R.start()
        started.append(job.state())  # what the quorum (and a heal) left this group with
        data_rank, step = int(rid) * world + rank, R.step
        if i == plan.get("die_at"):
            for *_, dp, _, _ in [(None, *p) for p in job.parts]:
                _loss(dp, *_batch(data_rank, step, 0))
            os._exit(3)  # mid-step: the peers' reductions of this step lose their partner
        job.backward(data_rank, step)
        # the memory this step wrote (staged until torchft's verdict: comm.guard)
        before = [{k: v.clone() for k, v in (dp.compressor.feedback._staged or {}).items()}
                  for _, dp, _, _ in job.parts]
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
        dropped = dropped or (ok and R.participants < 3)
        if dropped and coord is not None and not plan.get("healing") and R.participants < 3:
            coord.wait(["up"])  # a blocking wait on the restarted group's word, no sleep
        if ok and R.participants == 3 and (dropped or plan.get("healing")):
            joined += 1
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


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b
