"""Pipeline schedules as data: per rank, an ordered list of actions that one runtime loop
executes (pyfast/parallel/pipeline.py), in the manner of torch.distributed.pipelining's
action lists. Names follow torch: F forward, B full backward, I input-gradient backward,
W weight-gradient backward; SEND_F/RECV_F move activations down, SEND_B/RECV_B gradients up.

`stage` is the global (virtual) stage index; stage s lives on rank s % p (Megatron's
interleaving), so with v virtual stages rank r holds stages r, r + p, ..., r + (v - 1) p.
`partition` lays the layers out over the stages; a generator returns a rank's compute actions;
`lower` adds the transfers. `simulate` runs the
lists against their data dependencies (no processes): tests use it to prove that an order
cannot deadlock and to compare its bubble with the formula.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from pyfast._partition import partition  # noqa: F401  (Pipeline's stage cut, torch-free)
from pyfast.perf import clock

F, B, I, W = "F", "B", "I", "W"  # noqa: E741  (torch's name for the input-gradient backward)
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, I, W)


def layer_times(seq: nn.Sequential, example: torch.Tensor, group=None, repeats: int = 3) -> list[float]:
    """Median forward+backward seconds of each layer on `example`, averaged over the group's ranks
    (an all-reduce) so that every rank computes the same partition."""
    times, h = [], example
    for layer in seq:
        x = h.detach().requires_grad_(h.is_floating_point())
        runs = []
        for _ in range(repeats):
            t0 = clock(example.device)  # on CUDA: after the queued work, else it times launches
            out = layer(x)
            wrt = [t for t in (x, *layer.parameters()) if t.requires_grad]
            if out.requires_grad and wrt:
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            runs.append(clock(example.device) - t0)
        times.append(sorted(runs)[repeats // 2])
        h = out.detach()
    t = torch.tensor(times, dtype=torch.float64, device=example.device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:  # None: the default group
        dist.all_reduce(t, group=group)
    return t.tolist()


class Action(NamedTuple):
    kind: str
    mb: int
    stage: int

    def __repr__(self):
        return f"{self.kind}{self.mb}@{self.stage}"


def gpipe(rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    """All forwards, then all backwards (Huang et al. 2019): m micro-batches in flight."""
    return [Action(F, k, rank) for k in range(m)] + [Action(B, k, rank) for k in range(m)]


def one_f_one_b(rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    """PipeDream-flush (Narayanan et al. 2021): p - 1 - rank warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards. At most p - rank
    micro-batches of activations are held."""
    warm = min(p - 1 - rank, m)
    out = [Action(F, k, rank) for k in range(warm)]
    for k in range(m - warm):
        out += [Action(F, warm + k, rank), Action(B, k, rank)]
    return out + [Action(B, k, rank) for k in range(m - warm, m)]


def zb_h1(rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    """Zero-bubble H1 (Qi et al. 2023): 1F1B's order with each backward split into I (input
    gradient, on the critical path: it is what the previous stage waits for) and W (weight
    gradient, which nobody waits for). Rank r runs each W r micro-batches late, the same lag
    as torch's ZB1P, so the later ranks, whose cool-down would idle, finish their Is first and
    fill the end with Ws; rank r then holds at most p micro-batches (rank 0 holds p under 1F1B)."""
    warm = min(p - 1 - rank, m)
    out = [Action(F, k, rank) for k in range(warm)]
    done_w = 0
    for k in range(m):
        if k < m - warm:
            out.append(Action(F, warm + k, rank))
        out.append(Action(I, k, rank))
        if k >= rank:
            out.append(Action(W, done_w, rank))
            done_w += 1
    return out + [Action(W, k, rank) for k in range(done_w, m)]


def interleaved_1f1b(rank: int, p: int, m: int, v: int = 2) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron's virtual stages), in torch's flexible
    form: micro-batches go round the v local stages in rounds of m // max(1, m // p); warm-up is
    (v - 1) rounds plus 2 (p - 1 - rank) forwards. The fill and drain shrink by v because each
    local stage is 1/v of the rank's layers."""
    rounds = max(1, m // p)
    per_round = m // rounds
    if m % rounds:
        raise ValueError(f"interleaved-1f1b needs n_microbatches divisible by max(1, "
                         f"n_microbatches // ranks) = {rounds}; got {m} with {p} ranks")
    total = m * v
    warm = min((v - 1) * per_round + 2 * (p - 1 - rank), total)

    def fwd_stage(i):
        return (i // per_round) % v * p + rank

    def bwd_stage(i):
        return (v - 1 - (i - warm) // per_round % v) * p + rank

    next_f, next_b = {}, {}
    out = []

    def add(kind, s, counter):
        counter[s] = counter.get(s, -1) + 1
        out.append(Action(kind, counter[s], s))

    for i in range(total + warm):
        if i < total:
            add(F, fwd_stage(i), next_f)
        if i >= warm:
            add(B, bwd_stage(i), next_b)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved-1f1b": interleaved_1f1b,
             "zb-h1": zb_h1}


def compute_actions(schedule: str, rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    if v > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"virtual_stages={v} needs schedule='interleaved-1f1b', not {schedule!r}")
    return SCHEDULES[schedule](rank, p, m, v)


def forward_only(actions: list[Action]) -> list[Action]:
    """The forwards of a training order, for inference (a forward waits only on forwards, so
    dropping the backwards cannot create a cycle)."""
    return [a for a in actions if a.kind == F]


def lower(actions: list[Action], n_stages: int, lookahead: int = 1) -> list[Action]:
    """Insert the transfers. Each receive is posted `lookahead` compute actions before the action
    that consumes it (posting never blocks; the consumer waits), so the data arrives while those
    compute. Posting early matters with gloo: a send leaves only after the sender's I/O thread
    has read the receiver's "ready" notice. Each send follows the action that produced its tensor."""
    def recv_for(a):
        if a.kind == F and a.stage > 0:
            return Action(RECV_F, a.mb, a.stage)
        if a.kind in (B, I) and a.stage < n_stages - 1:
            return Action(RECV_B, a.mb, a.stage)
        return None

    posts: dict[int, list[Action]] = {}
    for i, a in enumerate(actions):
        if (r := recv_for(a)) is not None:
            posts.setdefault(max(0, i - lookahead), []).append(r)
    out = []
    for i, a in enumerate(actions):
        out += posts.get(i, [])
        out.append(a)
        if a.kind == F and a.stage < n_stages - 1:
            out.append(Action(SEND_F, a.mb, a.stage))
        elif a.kind in (B, I) and a.stage > 0:
            out.append(Action(SEND_B, a.mb, a.stage))
    return out


def simulate(lists: list[list[Action]], n_stages: int, cost=None, comm: float = 0.0) -> dict:
    """Run compute-only lists (one per rank) in order against their dependencies. Returns
    {"end": makespan, "busy": per-rank compute time, "bubble": 1 - sum(busy) / (p * end),
    "timeline": per-rank [(start, end, action)]}. Raises RuntimeError on a deadlock."""
    cost = cost or {F: 1.0, B: 2.0, I: 1.0, W: 1.0}
    p = len(lists)
    done: dict[tuple, float] = {}
    pos, free = [0] * p, [0.0] * p
    timeline: list[list] = [[] for _ in range(p)]

    def ready(a):  # time at which a's inputs are available on its rank, or None
        deps = []
        if a.kind == F and a.stage > 0:
            deps.append(((F, a.mb, a.stage - 1), comm))
        if a.kind in (B, I):
            deps.append(((F, a.mb, a.stage), 0.0))
            if a.stage < n_stages - 1:
                after = (B, a.mb, a.stage + 1)
                deps.append((after if after in done else (I, a.mb, a.stage + 1), comm))
        if a.kind == W:
            deps.append(((I, a.mb, a.stage), 0.0))
        t = 0.0
        for key, delay in deps:
            if key not in done:
                return None
            t = max(t, done[key] + delay)
        return t

    while any(pos[r] < len(lists[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                t = ready(a)
                if t is None:
                    break
                start = max(t, free[r])
                free[r] = start + cost[a.kind]
                done[(a.kind, a.mb, a.stage)] = free[r]
                timeline[r].append((start, free[r], a))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: lists[r][pos[r]] for r in range(p) if pos[r] < len(lists[r])}
            raise RuntimeError(f"schedule deadlocks: ranks wait at {stuck}")
    end = max(free)
    busy = [sum(e - s for s, e, _ in tl) for tl in timeline]
    return {"end": end, "busy": busy, "bubble": 1 - sum(busy) / (p * end), "timeline": timeline}


def held(actions: list[Action]) -> int:
    """Most micro-batches whose activations one rank holds at once: from F until B, or until W
    when the backward is split (the graph stays alive for the weight gradient)."""
    split = any(a.kind == W for a in actions)
    release = W if split else B
    live = peak = 0
    for a in actions:
        live += (a.kind == F) - (a.kind == release)
        peak = max(peak, live)
    return peak
