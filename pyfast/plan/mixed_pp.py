"""Pipeline stages across GPU types (pp > 1, each stage on one type: mixed.placement_problem):
the step with the job's own cut of [Embed, Block x L, Head], even (`--pp` alone) and weighted
by each pp rank's speed (`pyfast train --pp-balance c0,c1,...`, Pipeline.from_sequential's
stage_costs: pyfast._partition.partition minimises the slowest stage's parameters x cost).

A stage's micro-batch on its type: the forward + backward (+ recompute) of its modules
(timing_compute._module_s on the type's cluster) plus tp / cp's per-block communication as
the one-type prediction prices it. The pipeline (1F1B, GPipe) then takes (m - 1) x the
slowest stage + the sum over stages (fill and drain: the homogeneous (m + p - 1) x t when all
are equal); zb-h1 a third of the fill and drain. The rest of the step (exposed dp / ZeRO
communication, the small all-reduce, the optimizer) is the slowest type's from its one-type
prediction. Interleaved schedules stay even (v > 1: not weighted here).
Memory: each stage's predicted peak (memory.predict_memory's per_stage, the even cut) scaled
by its blocks under the weighted cut over the even cut's, on its own type: an estimate (the
embedding's and head's bytes do not scale), stated as such in docs/plan.md.
"""
from __future__ import annotations

from pyfast._partition import partition

from .memory import _partition, predict_memory
from .spec import Plan
from .timing_compute import _block_params, _module_s, _modules

WEIGHTED = ("1f1b", "gpipe", "zb-h1")


def stage_types(mc, plan: Plan) -> list[int]:
    """The group of each pipeline stage (stage s: ranks [s x D, (s + 1) x D), D = dp x cp x tp)."""
    d = plan.dp * plan.cp * plan.tp
    return [mc.group_of(s * d) for s in range(plan.pp)]


def _weights(shape, tp: int) -> list[int]:
    """Parameters of [Embed, Block x L, Head] on a tp rank (memory._partition's weights)."""
    from .memory import _layer_tensors, _vocab_split
    vt = _vocab_split(shape, tp)
    head = 2 * shape.hidden + (0 if shape.tied else shape.vocab * shape.hidden // vt)
    return [shape.vocab * shape.hidden // vt] + [sum(_layer_tensors(shape, tp))] * \
        shape.layers + [head]


def _kinds_s(pr, i: int, plan: Plan) -> tuple[float, float, float]:
    """(embed, block, head) seconds (f + b + r) of one micro-batch on type i, memoised."""
    key = ("kinds", i, plan)
    if key not in pr.t:
        shape, work, cl = pr.shape, pr.work, pr.clusters[i]
        mods = (_modules(shape, plan, 0)[0], ("block", _block_params(shape, plan.tp)),
                _modules(shape, plan, plan.pp - 1)[-1])
        pr.t[key] = tuple(sum(_module_s(k, ps, shape, plan, work, cl)) for k, ps in mods)
    return pr.t[key]


def _stage_s(pr, i: int, plan: Plan, lo: int, hi: int, per_block_comm: float) -> float:
    """One micro-batch through layers [lo, hi) of the sequence on type i (f + b + r + comm)."""
    embed, block, head = _kinds_s(pr, i, plan)
    n = pr.shape.layers + 2
    blocks = min(hi, n - 1) - max(lo, 1)
    return (embed if lo == 0 else 0.0) + (head if hi == n else 0.0) + \
        max(0, blocks) * (block + per_block_comm)


def _body(plan: Plan, ts: list[float]) -> float:
    fill = sum(ts) - max(ts)
    return plan.micro_batches * max(ts) + (fill / 3 if plan.schedule == "zb-h1" else fill)


def _rest_and_comm(pr, i: int, plan: Plan) -> tuple[float, float, dict]:
    """(the step beyond the pipeline body, tp + cp seconds a block, the prediction) on type i."""
    t = pr.time(i, plan)
    nblocks = sum(k == "block" for k, _ in _modules(pr.shape, plan, t["stage"]))
    body = t["compute_s"] + t["tp_comm_s"] + t["cp_comm_s"] + t["bubble_s"] + t["pp_comm_s"]
    comm = (t["tp_comm_s"] + t["cp_comm_s"]) / max(1, plan.micro_batches * nblocks)
    return t["step_s"] - body, comm, t


def costs_of(pr, plan: Plan, kinds: list[int]) -> list[float]:
    """--pp-balance: each pp rank's block seconds on its type over the fastest's (2 = half)."""
    blk = {i: _kinds_s(pr, i, plan)[1] for i in set(kinds)}
    fast = min(blk.values())
    return [round(blk[i] / fast, 3) for i in kinds]


def price(pr, plan: Plan, counts: list[int], kinds: list[int], split) -> dict:
    """The step of the cut `counts` with stage s on type kinds[s] (module doc)."""
    rest = {i: _rest_and_comm(pr, i, plan) for i in set(kinds)}
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    ts = [_stage_s(pr, k, plan, bounds[s], bounds[s + 1], rest[k][1])
          for s, k in enumerate(kinds)]
    slow = max(rest, key=lambda i: rest[i][0])
    t = dict(rest[slow][2])
    body = _body(plan, ts)
    t["step_s"] = body + rest[slow][0] + max(r[2]["pp_comm_s"] for r in rest.values())
    t["bubble_s"] = body - plan.micro_batches * max(ts)
    t["tokens_per_s"] = pr.work.tokens / t["step_s"]
    names = [pr.mc.groups[k].name for k in kinds]
    t["per_type"] = {}
    for n, x in zip(names, ts):
        t["per_type"][n] = max(t["per_type"].get(n, 0.0), x)
    t["slowest"] = names[ts.index(max(ts))]
    t["layers"] = [c - (s == 0) - (s == len(counts) - 1) for s, c in enumerate(counts)]
    t["split"] = split
    return t


def memory(pr, plan: Plan, even: list[int], counts: list[int], kinds: list[int]) -> dict | None:
    """{type name: the most any of its stages needs} under the cut, or None if one does not
    fit its GPU (module doc: the even cut's per-stage peaks scaled by blocks)."""
    out = {}
    for i in set(kinds):
        if ("stages", i, plan) not in pr.m:
            pr.m["stages", i, plan] = predict_memory(pr.shape, plan, pr.work,
                                                     pr.device(i))["per_stage"]
        per = pr.m["stages", i, plan]
        for s, k in enumerate(kinds):
            if k != i:
                continue
            scale = max(1.0, counts[s] / max(1, even[s]))
            need = int(per[s] * scale)
            if need > pr.clusters[i].gpu.memory_bytes:
                return None
            name = pr.mc.groups[i].name
            out[name] = max(out.get(name, 0), need)
    return out


def pipeline(pr, plan: Plan) -> tuple[dict, dict | None]:
    """(even, weighted) predictions of a pp plan whose stages lie on types; weighted None when
    the stages are all one type, the schedule is interleaved or the cut does not change."""
    kinds = stage_types(pr.mc, plan)
    w = _weights(pr.shape, plan.tp)
    even_cut = list(_partition(pr.shape, plan.pp, plan.tp))
    split = [plan.micro_batch * plan.micro_batches] * plan.dp
    even = price(pr, plan, even_cut, kinds, split)
    even["memory"] = memory(pr, plan, even_cut, even_cut, kinds)
    if len(set(kinds)) < 2 or plan.schedule not in WEIGHTED:
        return even, None
    costs = costs_of(pr, plan, kinds)
    cut = partition(w, plan.pp, costs)
    if cut == even_cut:
        return even, None
    mem = memory(pr, plan, even_cut, cut, kinds)
    if mem is None:
        return even, None
    t = price(pr, plan, cut, kinds, split)
    t["memory"], t["pp_balance"] = mem, costs
    return even, t
