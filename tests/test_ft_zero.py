"""ZeRO-2 hybrid sharding under torchft (zero(..., replicas=R): hybrid.Quorum) against the same
hybrid sharding over a fixed replica group, on gpt-tiny (tests/test_ft.py's model and data)."""
from __future__ import annotations

import torch

from dist_utils import RankPool
from ft_utils import equal as _equal, group_env, lighthouse, run_groups, store_port
from test_ft import LR, WD, _batch, _flat, _loss, _model, _replicas
from test_zero_hybrid import _groups
KW = dict(stage=2, compressor="int8", replica_compressor="int8", lr=LR, weight_decay=WD)


def _state(model, opt) -> dict:
    mem = lambda c: {k: v.clone() for k, v in c.feedback.memory.items()}  # noqa: E731
    return {"params": _flat(model.module), "shard": mem(model.compressor),
            "replica": mem(model.replicas.compressor)}


def _reference(rank, world, steps):
    """Hybrid ZeRO-2 over 4 ranks: shards {0,1} {2,3}, replicas {0,2} {1,3}."""
    from pyfast.parallel import zero
    mine = _groups()
    model, opt = zero(_model(0), torch.optim.AdamW, group=mine[0], replica_group=mine[1], **KW)
    out = []
    for s in range(steps):
        _loss(model, *_batch(rank, s, 0)).backward()
        opt.step()
        opt.zero_grad()
        out.append(_state(model, opt))
    model.close()
    return out


def _group(rank, world, port, addr, rid, steps, bad):
    """One replica group of 2 ranks; group 0 reports an error at step `bad`."""
    from pyfast.parallel import zero
    group_env(port)
    R = _replicas(addr, rid, 2)
    model, opt = zero(_model(0), torch.optim.AdamW, replicas=R, **KW)
    out, log = [], []
    for s in range(steps):
        R.start()
        _loss(model, *_batch(int(rid) * world + rank, R.step, 0)).backward()
        if s == bad and rid == "0":
            R.report(RuntimeError("injected failure"))
        ok = R.commit()
        if ok:
            opt.step()
        opt.zero_grad()
        log.append((R.step, R.participants, ok))
        out.append(_state(model, opt))
    model.close()
    R.close()
    return {"log": log, "states": out}


def test_zero2_under_torchft_equals_hybrid_zero_and_a_failed_commit_rolls_back(pool4):
    """2 replica groups of 2 ranks, ZeRO-2 with int8 inside the group and int8 across: the same
    bits as hybrid ZeRO-2 over 4 ranks (the replica all-reduce summed on the quorum's group,
    divided by the 2 participants: the reference's average). At the last step group 0 reports
    an error: it does not commit (parameters stay; both error-feedback memories, the shard
    group's and the replica one's, are as before the step); group 1 commits it."""
    steps = 3
    bad = steps - 1
    ref = pool4.run(_reference, steps)
    with RankPool(2) as a, RankPool(2) as b, lighthouse(2) as addr:
        out = run_groups([a, b], _group, [(store_port(p), addr, str(g), steps, bad)
                                          for g, p in enumerate((a, b))])
    for g in range(2):
        for r in range(2):
            res, theirs = out[g][r], ref[g * 2 + r]
            assert [ok for *_, ok in res["log"]] == [True] * bad + [g == 1], res["log"]
            for s in range(bad if g == 0 else steps):
                for k in ("params", "shard", "replica"):
                    assert _equal(res["states"][s][k], theirs[s][k]), (g, r, s, k)
            if g == 0:
                for k in ("params", "shard", "replica"):
                    assert _equal(res["states"][bad][k], res["states"][bad - 1][k]), (r, k)
                    # ... which moved at every committed step, so the check has teeth
                    assert not _equal(theirs[bad][k], theirs[bad - 1][k]), (r, k)
