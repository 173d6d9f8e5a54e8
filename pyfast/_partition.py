"""The pipeline's layer partition, torch-free: Pipeline (pyfast.parallel.schedules) cuts its
stages with it, and the planner (pyfast.plan.memory) sizes the same stages without importing
torch (10,000 plans are scored in seconds; `import torch` alone takes ~2 s)."""
from __future__ import annotations


def partition(weights: list[float], n_stages: int) -> list[int]:
    """Layer counts of `n_stages` contiguous stages that minimise the heaviest stage, ties going
    to the most even layer counts (Linear+ReLU pairs then split between a ReLU and a Linear)."""
    n = len(weights)
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)
    worst = (float("inf"), n)
    best = [[worst] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                c = max(best[k - 1][j], (pre[i] - pre[j], i - j))
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    counts, i = [], n
    for k in range(n_stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]
