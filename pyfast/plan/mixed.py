"""Plans for a mixed cluster (nodes.MixedCluster: node groups of different GPU types): where
each parallel group goes, how the batch (or the layers) split by speed, and the predicted step.

Placement. Ranks are numbered group by group (the file's [[nodes]] order) and the job's mesh
puts tp innermost, then cp, dp, pp outermost (pyfast.parallel.mesh.DIMS): a tp x cp group is
tp x cp consecutive ranks, a dp replica (pp 1) too, a pipeline stage dp x cp x tp. A mesh is
kept only if every tp x cp group (and, pp > 1, every stage) lies in one group, so on one GPU
type (tp and cp also inside a node, unless --allow-cross-node-tp); so tp never spans types.

Data parallel across types (pp 1): each replica's rank prices its step on its own type
(timing.predict_time on MixedCluster.for_job: the type's GPU and intra-node link, between
nodes the slowest link), and the step is the slowest replica's (the reduction waits for it):
    even:   every replica global / dp samples;
    uneven: samples in proportion to each replica's speed (micro_batch / its compute seconds),
            in units of the plan's micro-batches (each rank's share splits into them), by
            largest remainder, each >= 1 unit and within what its GPU's memory holds, then
            moved one unit at a time from the slowest replica to the fastest while the
            predicted step drops: `pyfast train --batch-split n0,n1,...` (one per dp rank;
            not with cp > 1, which the job refuses with a split: those plans stay even).
Pipeline stages across types (pp > 1, each stage on one type): the job's cut even and
weighted by each pp rank's speed (`pyfast train --pp-balance c0,c1,...`): mixed_pp.py.
Memory is checked per type: each type's ranks at their own share must fit its GPU.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .finetune import DEFAULT_RANK
from .memory import predict_memory
from .mixed_pp import pipeline
from .nodes import MixedCluster
from .search import (TIE_BAND, finetune_variants, mesh_plans, mesh_problem, meshes,
                     prefer_simple, solo)
from .spec import ModelShape, Plan, Workload
from .timing import predict_time

GiB = 2**30
REFINE_MOVES = 16  # one-unit moves after the proportional split (it lands within 1-2 units)


@dataclass
class MixedScored:
    """One plan on a mixed cluster: `plan` with the even split (its micro_batch), `even` /
    `uneven` predictions ({"step_s", "tokens_per_s", "per_type": {name: step_s}, "split":
    samples per dp rank, "memory": {name: peak bytes}}), uneven None where it does not apply
    or does not pay."""
    plan: Plan
    even: dict
    uneven: dict | None = None
    reason: str = ""
    diloco: None = None  # (render.describe's: no DiLoCo plans on a mixed cluster)

    @property
    def best(self) -> dict:
        return self.uneven if self.uneven and \
            self.uneven["step_s"] < self.even["step_s"] else self.even

    @property
    def time(self) -> dict:  # the attributes search.prefer_simple and render read
        return self.best

    @property
    def peak(self) -> int:
        return max(self.best["memory"].values())

    @property
    def to_target_s(self) -> float:
        return self.best["step_s"] * self.best["steps_factor"]

    @property
    def gain(self) -> float:
        """even step / chosen step (1.0: the even split is chosen)."""
        return self.even["step_s"] / self.best["step_s"]

    def flags(self) -> list[str]:
        """The job flags the split adds: --batch-split n0,n1,... where uneven."""
        b = self.best
        if b is not self.uneven:
            return []
        if b.get("pp_balance"):
            return ["--pp-balance", ",".join(f"{c:g}" for c in b["pp_balance"])]
        return ["--batch-split", ",".join(map(str, b["split"]))]


@dataclass
class MixedResult:
    plans: list[MixedScored]
    rejected: list[MixedScored]
    mesh_problems: dict = field(default_factory=dict)
    fitting: int = 0
    scored: int = 0
    seconds: float = 0.0


def placement_problem(mc: MixedCluster, dp: int, cp: int, tp: int, pp: int,
                      cross_node: bool = False) -> str | None:
    """Why the mesh cannot keep each tp x cp group (and pp stage) on one GPU type (and tp x
    cp inside a node), or None."""
    span = tp * cp
    what = "tp" if cp == 1 else "tp x cp" if tp > 1 else "cp"
    for g in mc.groups:
        if g.gpus % span:
            return f"{what} = {span} ranks would span GPU types ({g.name}: {g.gpus} GPUs)"
        if not cross_node and span > 1 and g.gpus_per_node % span:
            return (f"{what} = {span} ranks would cross nodes of {g.gpus_per_node} {g.name} "
                    "(--allow-cross-node-tp allows it)")
        if pp > 1 and g.gpus % (dp * span):
            return (f"a pipeline stage (dp x cp x tp = {dp * span} ranks) would span GPU types "
                    f"({g.name}: {g.gpus} GPUs)")
    return None


def replica_types(mc: MixedCluster, plan: Plan) -> list[int]:
    """The group index of each dp rank's replica (pp 1: tp x cp consecutive ranks)."""
    return [mc.group_of(r * plan.tp * plan.cp) for r in range(plan.dp)]


def largest_remainder(weights: list[float], total: int, lo: list[int], hi: list[int]
                      ) -> list[int]:
    """`total` whole units split in proportion to `weights` (largest remainder: each gets the
    floor of its quota, the leftovers go to the largest fractions, ties to the first), each
    within [lo, hi]: quotas over a bound are clamped and the rest shared again by weight.
    A floor met after a cap can overshoot: one unit at a time is then moved within bounds."""
    n = len(weights)
    if sum(lo) > total or sum(hi) < total:
        raise ValueError(f"{total} units do not fit between {lo} and {hi}")
    fixed: dict[int, int] = {}
    while True:  # clamp the quotas over their cap first (the rest's quotas only drop), then
        free = [i for i in range(n) if i not in fixed]  # those under their floor
        left = total - sum(fixed.values())
        w = sum(weights[i] for i in free)
        quota = {i: left * weights[i] / w for i in free} if w > 0 else \
            {i: left / len(free) for i in free}
        over = {i: hi[i] for i, q in quota.items() if q > hi[i]} or \
            {i: lo[i] for i, q in quota.items() if q < lo[i]}
        if not over:
            break
        fixed.update(over)
    out = {i: int(q) for i, q in quota.items()}
    rest = left - sum(out.values())
    for i in sorted(free, key=lambda i: (-(quota[i] - out[i]), i))[:rest]:
        out[i] += 1
    out.update(fixed)
    while sum(out.values()) != total:  # a floor met after a cap (e.g. [5, 1] into 3 with caps
        # [2, 3] and floors [1, 2]): give back or take one unit where the bounds allow it
        d = 1 if sum(out.values()) < total else -1
        i = next(i for i in sorted(range(n), key=lambda i: -weights[i] * d)
                 if lo[i] <= out[i] + d <= hi[i])
        out[i] += d
    return [out[i] for i in range(n)]


class _Pricer:
    """predict_time / predict_memory of a plan on one type, memoised per (type, plan)."""

    def __init__(self, shape, work, mc: MixedCluster):
        self.shape, self.work, self.mc = shape, work, mc
        self.clusters = [mc.for_job(i) for i in range(len(mc.groups))]
        self.t, self.m = {}, {}
        self.calls = 0

    def device(self, i: int) -> str:
        return "cpu" if self.clusters[i].gpu.name == "cpu" else "cuda"

    def time(self, i: int, plan: Plan) -> dict:
        if (i, plan) not in self.t:
            self.t[i, plan] = predict_time(self.shape, plan, self.work, self.clusters[i])
        return self.t[i, plan]

    def peak(self, i: int, plan: Plan) -> int:
        if (i, plan) not in self.m:
            self.calls += 1
            self.m[i, plan] = predict_memory(self.shape, plan, self.work,
                                             self.device(i))["peak_bytes"]
        return self.m[i, plan]

    def fits(self, i: int, plan: Plan) -> bool:
        return self.peak(i, plan) <= self.clusters[i].gpu.memory_bytes


def _prediction(pr: _Pricer, plans: dict[int, Plan], split: list[int] | None) -> dict:
    """The step of ranks of types plans' keys each running its plan: the slowest one's."""
    per = {i: pr.time(i, p) for i, p in plans.items()}
    slow = max(per, key=lambda i: per[i]["step_s"])
    t = dict(per[slow])
    t["tokens_per_s"] = pr.work.tokens / t["step_s"]
    t["per_type"] = {pr.mc.groups[i].name: per[i]["step_s"] for i in per}
    t["slowest"] = pr.mc.groups[slow].name
    t["memory"] = {pr.mc.groups[i].name: pr.peak(i, p) for i, p in plans.items()}
    t["split"] = split
    return t


def uneven_split(pr: _Pricer, plan: Plan) -> dict | None:
    """The speed-proportional batch split of a dp plan whose replicas differ in type (module
    doc), or None (one type, or no split beats or fits beside the even one)."""
    kinds = replica_types(pr.mc, plan)
    types = sorted(set(kinds))
    if len(types) < 2 or plan.cp > 1:  # the job's --batch-split refuses --cp > 1 (untested)
        return None
    m, units = plan.micro_batches, plan.micro_batch * plan.dp  # units of m samples
    rate = {i: plan.micro_batch / max(pr.time(i, plan)["compute_s"], 1e-30) for i in types}
    hi = {}
    for i in types:  # the most units a rank of type i holds in memory (micro-batch b)
        top = units - (plan.dp - 1)
        lo_b, hi_b = 0, top
        while lo_b < hi_b:
            mid = (lo_b + hi_b + 1) // 2
            if pr.fits(i, plan.replace(micro_batch=mid)):
                lo_b = mid
            else:
                hi_b = mid - 1
        hi[i] = lo_b
    if any(hi[i] < 1 for i in types):
        return None
    caps = [hi[k] for k in kinds]
    if sum(caps) < units:
        return None
    split = largest_remainder([rate[k] for k in kinds], units, [1] * plan.dp, caps)

    def step(sp):
        return max(pr.time(k, plan.replace(micro_batch=b))["step_s"] for k, b in zip(kinds, sp))
    best = step(split)
    for _ in range(REFINE_MOVES):  # one unit from the slowest replica to the fastest
        ts = [pr.time(k, plan.replace(micro_batch=b))["step_s"] for k, b in zip(kinds, split)]
        s, f = ts.index(max(ts)), ts.index(min(ts))
        if s == f or split[s] <= 1 or split[f] >= caps[f]:
            break
        trial = list(split)
        trial[s] -= 1
        trial[f] += 1
        t = step(trial)
        if t >= best:
            break
        split, best = trial, t
    plans = {}
    for k, b in zip(kinds, split):  # the slowest of each type's ranks (by its share)
        p = plan.replace(micro_batch=b)
        if k not in plans or pr.time(k, p)["step_s"] > pr.time(k, plans[k])["step_s"]:
            plans[k] = p
    return _prediction(pr, plans, [b * m for b in split])


def search_mixed(shape: ModelShape, work: Workload, mc: MixedCluster, top: int = 10,
                 cross_node: bool = False, finetune: str = "full",
                 lora_rank: int = DEFAULT_RANK, tie_band: float | None = None,
                 rejected: int | None = None, distinct: bool = True) -> MixedResult:
    """search.search's plans (no offload, no hybrid sharding, no DiLoCo: one shard group of
    every rank) placed on `mc` (placement_problem), each priced even and, where replicas differ
    in type, unevenly split (module doc); ranked by the better of the two. distinct: leave
    out a plan that scores as one listed (to 0.1%), as search.search."""
    tie_band = TIE_BAND if tie_band is None else tie_band
    t0 = time.perf_counter()
    variants = finetune_variants(finetune, work, lora_rank)
    pr = _Pricer(shape, work, mc)
    res = MixedResult([], [])
    fits, oom = [], {}
    types = range(len(mc.groups))
    for dp, cp, tp, pp in meshes(mc.gpus):
        why = mesh_problem(shape, work, pr.clusters[0], dp, cp, tp, pp, cross_node=True) or \
            placement_problem(mc, dp, cp, tp, pp, cross_node)
        if why:
            res.mesh_problems[(dp, cp, tp, pp)] = why
            continue
        for group in mesh_plans(shape, work, dp, cp, tp, pp, variants):
            if solo(group[0]):
                continue
            for plan in group:  # micro-batch ascending: the first that does not fit ends it
                res.scored += 1
                even = [plan.micro_batch * plan.micro_batches] * dp
                if pp > 1:  # each type holds its own stages (mixed_pp)
                    e, u = pipeline(pr, plan)
                    if e["memory"] is None:
                        s = MixedScored(plan, dict(e, memory={"?": 0}),
                                        reason="OOM: a pipeline stage does not fit its GPU "
                                        "type's memory")
                        oom.setdefault((dp, cp, tp, pp, plan.zero, plan.base_dtype), s)
                        break
                    fits.append(MixedScored(plan, e, u))
                    continue
                over = [i for i in types if not pr.fits(i, plan)]
                if over:
                    i = over[0]
                    k = (dp, cp, tp, pp, plan.zero, plan.base_dtype)
                    s = MixedScored(plan, _prediction(pr, {j: plan for j in types}, even))
                    cap = pr.clusters[i].gpu.memory_bytes
                    s.reason = (f"OOM on {mc.groups[i].name} by "
                                f"{(pr.peak(i, plan) - cap) / GiB:.1f} GiB "
                                f"({pr.peak(i, plan) / GiB:.1f} of {cap / GiB:.1f} GiB)")
                    if k not in oom or s.peak < oom[k].peak:
                        oom[k] = s
                    break
                s = MixedScored(plan, _prediction(pr, {i: plan for i in types}, even))
                if pp == 1 and dp > 1:
                    s.uneven = uneven_split(pr, plan)
                fits.append(s)
    fits = prefer_simple(sorted(fits, key=lambda s: (s.to_target_s, s.peak)), tie_band)
    res.fitting = len(fits)
    seen = set()
    for s in fits:  # the top N distinct (a plan scoring as one listed, to 0.1%, is a tie)
        k = (round(math.log(s.to_target_s) * 1000), round(math.log(max(s.peak, 1)) * 1000))
        if distinct and k in seen:
            continue
        seen.add(k)
        res.plans.append(s)
        if len(res.plans) == top:
            break
    res.rejected = sorted(oom.values(), key=lambda s: s.to_target_s)[
        :top if rejected is None else rejected]
    res.seconds = time.perf_counter() - t0
    return res
