"""Speed-weighted pipeline stages (issue 36, mixed hardware): what each pp rank's stage costs.

Pipeline.from_sequential(..., stage_costs=C) takes one float per rank of the pipeline's group,
the relative seconds that rank takes for the same work (2.0 = half as fast), or "measure":
every rank times the same matmul probe on its own device (probe), the ranks all-reduce their
times, and costs = time / min(time). The all-reduce leaves the same numbers on every rank, so
every rank derives the same partition (pyfast._partition.partition with costs). With v virtual
stages stage s runs on rank s % p and costs cost[s % p] (per_stage).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pyfast._partition import check_costs, partition
from pyfast.comm.agree import exchange_device
from pyfast.perf import clock

from . import schedules

# Probe: as long as five CFS periods (100 ms each): a CPU-capped rank (pyfast.hetero.throttle,
# a quota per period) runs a burst shorter than its quota at full speed. A process capped at
# 0.5 CPU against itself uncapped, 5 repeats each (Intel Xeon, 2 cores, loaded; the
# throttled/free truth 2.03): 20 ms probes read 0.98-1.38x, 0.1 s 1.06-2.04x, 0.5 s 1.84-1.92x,
# 1 s 1.96-2.16x. 0.5 s: within 10% for half a second of the job's start.
PROBE_S = 0.5
PROBE_ROWS = 256  # the probe's tokens per matmul: a micro-batch of gpt-small is 2 x 256


def problem(stage_costs, stage_memory, balance, p: int, device: torch.device) -> str | None:
    """What is wrong with stage_costs / stage_memory for a pipeline of p ranks whose layers
    are on `device`, or None (no collective here: from_sequential's agreement raises it on
    every rank)."""
    if stage_memory is not None:
        if isinstance(balance, (list, tuple)):
            return (f"stage_memory with balance={list(balance)}: a list of layer counts is the "
                    "cut itself; give stage_memory with balance='params' or 'time'")
        try:
            check_costs(stage_memory, p, "stage_memory")
        except ValueError as e:
            return (f"{str(e).replace('relative seconds per unit of work', 'bytes')} (one byte "
                    f"budget per pp rank: the pipeline's group has {p} ranks)")
    if stage_costs is None:
        return None
    if isinstance(stage_costs, str) and stage_costs == "measure":
        if device.type == "meta":
            return ("stage_costs='measure' times a probe on the device: meta tensors (a dry "
                    "run) have no speed; give the costs or leave them out")
        return None
    if isinstance(stage_costs, str):
        return f"stage_costs must be one float per pp rank or 'measure', got {stage_costs!r}"
    if isinstance(balance, (list, tuple)):
        return (f"stage_costs {stage_costs!r} with balance={list(balance)}: a list of layer "
                "counts is the cut itself; give stage_costs with balance='params' or 'time'")
    try:
        check_costs(stage_costs, p, "stage_costs")
    except ValueError as e:
        return f"{e} (one per pp rank: the pipeline's group has {p} ranks)"
    return None


def shape(seq: nn.Sequential) -> tuple[int, int]:
    """(in, out) of the largest nn.Linear in seq (the probe's matmul), else (512, 512)."""
    big = max((m for m in seq.modules() if isinstance(m, nn.Linear)),
              key=lambda m: m.weight.numel(), default=None)
    return (big.in_features, big.out_features) if big is not None else (512, 512)


def probe(seq: nn.Sequential, device: torch.device, budget_s: float | None = None) -> float:
    """Seconds one [PROBE_ROWS, in] x [in, out] matmul takes here (in, out: seq's largest
    Linear; its dtype), the mean over as many as run in budget_s seconds (PROBE_S)."""
    budget_s = PROBE_S if budget_s is None else budget_s
    n_in, n_out = shape(seq)
    dtype = next((t.dtype for t in seq.parameters() if t.is_floating_point()), torch.float32)
    # made on the device itself: only the time of the product matters, not its values
    x = torch.randn(PROBE_ROWS, n_in, device=device, dtype=torch.float32).to(dtype)
    w = torch.randn(n_in, n_out, device=device, dtype=torch.float32).to(dtype)
    for _ in range(2):  # warm-up: kernels chosen, caches filled
        x @ w
    count, t0 = 0, clock(device)
    while True:
        for _ in range(3):  # a forward's and a backward's matmuls between clock readings
            y = x @ w
        count += 3
        elapsed = clock(device) - t0
        if elapsed >= budget_s:
            del y
            return elapsed / count


def measure(seq: nn.Sequential, group, rank: int, p: int, device: torch.device,
            budget_s: float | None = None) -> tuple[list[float], list[float]]:
    """(costs, seconds per probe matmul) of every rank of the group, the same on every rank:
    each rank probes, one all-reduce of a p-vector (this rank's slot filled) shares them."""
    mine = probe(seq, device, budget_s)
    t = torch.zeros(p, dtype=torch.float64, device=exchange_device(group, device))
    t[rank] = mine
    if p > 1:
        dist.all_reduce(t, group=group)
    secs = t.tolist()
    fastest = min(secs)
    return [s / fastest for s in secs], secs


def per_stage(costs: list[float] | None, n_stages: int, p: int) -> list[float] | None:
    """One cost per (virtual) stage: stage s runs on rank s % p."""
    return None if costs is None else [float(costs[s % p]) for s in range(n_stages)]


def cut(seq: nn.Sequential, n: int, p: int, balance, stage_costs, stage_memory, example,
        m: int, group, rank: int, device: torch.device):
    """(layer counts of the n stages, the costs per rank or None, each rank's probe seconds or
    None): the layers weighed by balance ("params", "time") and cut by partition with the
    ranks' costs (measured here for "measure": collective) and byte budgets; a list of layer
    counts as given."""
    probe_s = None
    if isinstance(balance, (list, tuple)):
        return list(balance), None, None
    if isinstance(stage_costs, str):  # "measure" (problem() refused any other word)
        stage_costs, probe_s = measure(seq, group, rank, p, device)
    if balance == "params":
        weights = [sum(t.numel() for t in layer.parameters()) for layer in seq]
    else:
        weights = schedules.layer_times(seq, example[: max(1, len(example) // m)], group)
    memory = capacity = None
    if stage_memory is not None:  # a rank's v stages share its budget: budget / v each
        memory = [sum(t.numel() * t.element_size() for t in (*layer.parameters(),
                                                             *layer.buffers())) for layer in seq]
        capacity = [float(stage_memory[s % p]) * p / n for s in range(n)]
    counts = partition(weights, n, per_stage(stage_costs, n, p), memory, capacity)
    return counts, stage_costs, probe_s
