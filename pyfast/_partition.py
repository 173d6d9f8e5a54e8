"""The pipeline's layer partition, torch-free: Pipeline (pyfast.parallel.schedules) cuts its
stages with it, and the planner (pyfast.plan.memory) sizes the same stages without importing
torch (10,000 plans are scored in seconds; `import torch` alone takes ~2 s).

Mixed hardware (issue 36): `costs[k]` is how long stage k's rank takes for the same work (2.0
= half as fast), so stage k's time is costs[k] x sum(its weights) and the cut minimises the
slowest stage's. `memory` / `capacity` keep a slow-but-big rank from being given more layers
than fit: stage k's summed layer bytes must be <= capacity[k].
"""
from __future__ import annotations

import math


def check_costs(costs, n: int, what: str = "costs") -> list[float]:
    """costs as floats, or ValueError naming the problem (wrong length, <= 0, NaN/Inf)."""
    try:
        out = [float(c) for c in costs]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be {n} numbers, got {costs!r}") from None
    if len(out) != n:
        raise ValueError(f"{what} has {len(out)} entries for {n} stages: one per stage")
    bad = [c for c in out if not (math.isfinite(c) and c > 0)]
    if bad:
        raise ValueError(f"{what} must be finite and > 0 (relative seconds per unit of work), "
                         f"got {out}")
    return out


def partition(weights: list[float], n_stages: int, costs: list[float] | None = None,
              memory: list[float] | None = None,
              capacity: list[float] | None = None) -> list[int]:
    """Layer counts of `n_stages` contiguous stages that minimise the slowest stage, ties going
    to the most even layer counts (Linear+ReLU pairs then split between a ReLU and a Linear).
    A stage's time is sum(its weights), times costs[k] for stage k when costs are given (None:
    every cost 1, the same cut bit for bit as without). memory (bytes per layer) and capacity
    (bytes per stage) bound what each stage may hold; ValueError if no cut fits."""
    n = len(weights)
    if costs is not None:
        costs = check_costs(costs, n_stages)
    if (memory is None) != (capacity is None):
        raise ValueError("memory (bytes per layer) and capacity (bytes per stage) go together")
    if memory is not None:
        if len(memory) != n:
            raise ValueError(f"memory has {len(memory)} entries for {n} layers")
        if len(capacity) != n_stages:
            raise ValueError(f"capacity has {len(capacity)} entries for {n_stages} stages")
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)
    mem = [0]
    for b in memory or ():
        mem.append(mem[-1] + b)
    worst = (float("inf"), n)
    best = [[worst] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                if memory is not None and mem[i] - mem[j] > capacity[k - 1]:
                    continue
                w = pre[i] - pre[j] if costs is None else (pre[i] - pre[j]) * costs[k - 1]
                c = max(best[k - 1][j], (w, i - j))
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    if best[n_stages][n][0] == float("inf"):
        raise ValueError(f"no cut of the {n} layers ({sum(memory or [])} bytes) into {n_stages} "
                         f"stages fits the capacities {list(capacity or [])} (bytes per stage)")
    counts, i = [], n
    for k in range(n_stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def stage_time(weights: list[float], counts: list[int], costs: list[float] | None = None) -> float:
    """The slowest stage's time of a cut: max over k of costs[k] x sum of stage k's weights."""
    out, i = 0.0, 0
    for k, c in enumerate(counts):
        out = max(out, sum(weights[i:i + c]) * (1.0 if costs is None else costs[k]))
        i += c
    return out


def on_a_line(ranks: int, virtual_stages: int) -> bool:
    """Whether a pipeline's ranks form a line (one stage a rank, or two ranks) rather than a
    ring (virtual stages on 3+ ranks: the last rank sends to the first). Only on a line may a
    gloo pipeline block on each send (Pipeline.from_sequential; the planner's memory model
    counts its send buffers by it): there a rank waits on a neighbour whose receives, posted in
    the pair's one order, never wait on it in turn; around a ring blocking sends can close a
    cycle of waits (interleaved-1f1b at 3 ranks hung so until session 55)."""
    return virtual_stages == 1 or ranks <= 2
