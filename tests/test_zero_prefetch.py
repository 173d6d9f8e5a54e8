"""zero(stage=3, prefetch=N) and offload="params" (issue 34, item 3) on gpt-tiny over 2 gloo
ranks, against the same run with prefetch=1 and no offload.

Tolerance: none (bitwise). Prefetch depth changes only when each unit's all-gather is issued,
never its bytes or the order of any reduction; offload="params" copies the same shard bytes to
the host and back (exact), so every loss and every parameter after the steps is bitwise the
reference's. Each case asserts that the path it names ran: the deepest prefetch seen, and the
host copies the gathers read.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

STEPS, LR, V, SEQ = 2, 1e-3, 61, 16  # V odd: ragged shards everywhere


def _build(lora=None, tied=True):
    from pyfast import models
    torch.manual_seed(0)
    m = models.build("gpt-tiny", V, SEQ, tie_embeddings=tied and lora is None)
    if lora is not None:
        from pyfast.models.lora import LoraOptions, apply_lora
        from pyfast.models.quant_base import quantize_base
        apply_lora(m, LoraOptions(4))
        quantize_base(m, lora)
    return m


def _data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, V, (2, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _run(rank, world, case):
    """Train STEPS steps under zero(**case["zero"]); losses, the trainable parameters after,
    the deepest prefetch (gathers in flight at once) and how many staged host copies a gather
    read."""
    import torch.distributed as dist

    from pyfast.parallel import zero
    m = _build(case.get("lora"), case.get("tied", True))
    model, opt = zero(m, torch.optim.AdamW, stage=3, lr=LR, weight_decay=0.1, **case["zero"])
    seen = {"depth": 0, "staged": 0}
    prefetch, start = model.prefetch, model._start

    def watched_prefetch(g):
        prefetch(g)
        seen["depth"] = max(seen["depth"], len(model._gathering))

    def watched_start(g):
        seen["staged"] += g.index in model._staged
        return start(g)
    model.prefetch, model._start = watched_prefetch, watched_start
    losses = []
    for s in range(STEPS):
        x, y = _data(s, rank)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t))
    model.gather_all()
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()
              if p.requires_grad}
    model.free_all()
    model.close()
    return {"losses": losses, "params": params, "units": len(model._order), **seen}


def _cases(rank, world, cases):
    return {name: _run(rank, world, case) for name, case in cases.items()}


def _equal(a, b, what):
    assert a["losses"] == b["losses"], what
    for n, v in a["params"].items():
        assert torch.equal(v, b["params"][n]), f"{what}: {n}"


CASES = {**{f"prefetch{n}": {"zero": {"prefetch": n}} for n in (1, 2)},
         # untied: 4 units (embed, 2 blocks, head), so depth 3 is reached
         **{f"untied{n}": {"zero": {"prefetch": n}, "tied": False} for n in (1, 3)}}


@pytest.mark.dist
def test_prefetch_depths_and_offload_are_bitwise_the_reference(pool2):
    for res in pool2.run(_cases, CASES):
        ref = res["prefetch1"]
        # gpt-tiny tied: units 2 blocks, head (the tied embedding in the root); untied: 4
        for name, n, base in (("prefetch2", 2, ref), ("untied1", 1, None),
                              ("untied3", 3, res["untied1"])):
            got = res[name]
            assert got["depth"] == n, (name, got["depth"], got["units"])
            if base is not None:
                _equal(got, base, name)
        assert ref["depth"] == 1


def _bad(rank, world):
    from pyfast.parallel import zero
    errors = []
    for kw in ({"stage": 2, "prefetch": 2}, {"stage": 2, "offload": "params"},
               {"stage": 3, "prefetch": 0}):
        try:
            zero(nn.Linear(5, 3), torch.optim.AdamW, **kw)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.dist
def test_bad_prefetch_and_offload_are_clear_errors(pool2):
    for depth, params, zero_depth in pool2.run(_bad):
        assert "prefetch=2 is how many units stage 3 gathers ahead; stage 2" in depth
        assert "offload='params' keeps stage 3's parameter shards in host memory" in params
        assert "prefetch must be an int >= 1" in zero_depth
