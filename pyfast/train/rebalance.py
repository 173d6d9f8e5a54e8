"""`--batch-split auto`: split each global batch over the dp ranks in proportion to their measured
speed (docs/hetero.md, "--batch-split auto").

Each rank times its own forward + backward of every step (the job's `_forward_backward`,
minus the seconds it waited on communication inside it) and divides by the samples it ran:
its compute seconds per sample. Every K steps (`--batch-split-every K`) the ranks all-gather
the median of their last window of steps, and every rank computes the same new split from the
same gathered numbers with `propose`, a pure deterministic function:

    target:      samples proportional to speed (1 / seconds per sample), each rank at least one
                 unit (the unit: --grad-accum x micro-batches, so every piece holds a sample),
                 the sum exactly --batch, rounded by largest remainder (ties to the lower rank)
    bounded:     at most MAX_MOVE of the batch changes rank per rebalance (one unit at a time,
                 from the rank furthest over its target to the one furthest under it)
    hysteresis:  the move is made only if it shortens the predicted slowest rank's compute,
                 max_r(n_r x s_r), by more than HYSTERESIS; otherwise the split stays

The data order never depends on the split: global batch s holds the same rows in the same order
(pyfast.data.Batches); the split only says which rank takes which contiguous rows, and the
sample-weighted reduction (DataParallel / zero `samples=`) makes the gradient that of the whole
global batch whatever the split. The split in force is logged per step (metrics.jsonl
`batch_split`) and saved in checkpoints (Job.state's "train" record); a run resumed at the same
dp size continues with it, at another dp size it starts again from the even split.

No torch import at module level: config.py parses the flags without torch.
"""
from __future__ import annotations

import math
import statistics
import time

# K: steps per measurement window. The window's median of per-step seconds/sample is what is
# compared, so one slow step (a GC pause, a neighbour's burst) does not move samples; 10 steps
# let the median ignore up to 4 outliers and cost one 16-byte all-gather per 10 steps (a
# rebalance is a few microseconds of arithmetic). A run reaches the speed-proportional split
# after 1-2 windows (MAX_MOVE), i.e. within its first 20 steps.
EVERY = 10
# At most this fraction of the global batch changes rank per rebalance: the even split of two
# ranks at 2:1 speed is batch/6 away from the best one, so one window fixes it; a wrong reading
# (a transient on one rank) can then cost at most a quarter of the batch for one window, and
# the next window, measured at the new sizes (per-sample time is not exactly linear in the
# batch), corrects it.
MAX_MOVE = 0.25
# Move only for a predicted gain above 5%: at a rounding boundary two neighbouring splits predict
# the same time (8,4 and 7,5 at 1.6:1), and a window's noise would otherwise move one unit back
# and forth; a unit of a 12-sample batch moves the prediction by 8-17%, so 5% still lets auto
# take every single-unit step that matters. Load noise is the window's (EVERY) job: medians of
# 3-step windows of one fixed split varied 2-26% on this 2-core box at load 19-34
# (bench/results/hetero_batch*.json), single steps up to 56%.
HYSTERESIS = 0.05
# the run's first step is not measured: it allocates and first-touches every buffer (gpt-small,
# bench/results/hetero_batch_first.json: step 1 took 2.1-3.1 s, later ones 1.7-2.5); the
# first step after a change of split was not slower (2.06 s), so it is measured
SETTLE = 1


def even(batch: int, ranks: int, unit: int = 1) -> list[int]:
    """The even split of `batch` over `ranks` (units of `unit`; the first ranks take the
    remainder's units). ValueError if a rank would get no unit."""
    if unit < 1 or batch % unit:
        raise ValueError(f"batch {batch} is not a multiple of the unit {unit}")
    units = batch // unit
    if units < ranks:
        raise ValueError(f"batch {batch} holds {units} units of {unit}: fewer than {ranks} ranks")
    q, r = divmod(units, ranks)
    return [unit * (q + (i < r)) for i in range(ranks)]


def check_split(split, batch: int, unit: int = 1) -> None:
    """ValueError naming the problem unless `split` is a list of multiples of `unit`, each
    >= unit, summing to `batch`."""
    if any(n < unit or n % unit for n in split):
        raise ValueError(f"split {list(split)}: every rank needs a multiple of {unit} samples, "
                         "at least one")
    if sum(split) != batch:
        raise ValueError(f"split {list(split)} sums to {sum(split)}, not the batch {batch}")


def target(secs: list[float], batch: int, unit: int = 1) -> list[int]:
    """The speed-proportional split: rank r's share of `batch` proportional to 1 / secs[r],
    in units, each rank >= 1 unit, largest-remainder rounding (ties to the lower rank)."""
    units, n = batch // unit, len(secs)
    speed = [1.0 / s for s in secs]
    fixed: dict[int, int] = {}  # ranks pinned at the one-unit floor
    while True:
        free = [i for i in range(n) if i not in fixed]
        left = units - len(fixed)
        total = sum(speed[i] for i in free)
        ideal = {i: left * speed[i] / total for i in free}
        low = [i for i in free if ideal[i] < 1]
        if not low:
            break
        for i in low:
            fixed[i] = 1
    out = [fixed.get(i, 0) for i in range(n)]
    for i in free:
        out[i] = math.floor(ideal[i])
    rest = units - sum(out)
    for i in sorted(free, key=lambda i: (-(ideal[i] - math.floor(ideal[i])), i))[:rest]:
        out[i] += 1
    return [unit * u for u in out]


def bounded(current: list[int], goal: list[int], max_samples: int, unit: int = 1) -> list[int]:
    """`current` moved toward `goal` one unit at a time, from the rank furthest over its goal to
    the one furthest under (ties to the lower rank), until `max_samples` have moved or it is
    there. Each step keeps the sum; a rank only moves toward its goal, so none falls below
    min(current, goal)."""
    cur = list(current)
    moved = 0
    while moved + unit <= max_samples:
        over = max(range(len(cur)), key=lambda i: (cur[i] - goal[i], -i))
        under = max(range(len(cur)), key=lambda i: (goal[i] - cur[i], -i))
        if cur[over] - goal[over] < unit or goal[under] - cur[under] < unit:
            break
        cur[over] -= unit
        cur[under] += unit
        moved += unit
    return cur


def predicted(split: list[int], secs: list[float]) -> float:
    """The slowest rank's compute seconds at `split`, if each rank's time is linear in its
    samples (what the balancer assumes between two measurements)."""
    return max(n * s for n, s in zip(split, secs))


def propose(current: list[int], secs: list[float], batch: int, unit: int = 1,
            max_move: float = MAX_MOVE, hysteresis: float = HYSTERESIS) -> list[int]:
    """The next split from the current one and each rank's measured seconds per sample: the
    same on every rank for the same numbers. Unchanged if a measurement is missing (not a
    positive finite number) or the bounded move gains no more than `hysteresis`."""
    if len(secs) != len(current):
        raise ValueError(f"{len(secs)} measurements for a split over {len(current)} ranks")
    check_split(current, batch, unit)
    if not all(math.isfinite(s) and s > 0 for s in secs):
        return list(current)
    step = max(unit, unit * math.floor(max_move * batch / unit))
    new = bounded(current, target(secs, batch, unit), step, unit)
    if predicted(new, secs) >= (1 - hysteresis) * predicted(current, secs):
        return list(current)
    return new


class Balancer:
    """One rank's side of --batch-split auto. The job calls `begin()` / `end(waited, samples)`
    around each step's forward + backward, then `step(step)`, which every `every` steps
    all-gathers the window's medians over `group` (every rank of the job: the tp / cp / pp
    ranks of one dp replica run the same rows, and the slowest of them sets that replica's
    speed) and returns the new split, or None when it is unchanged.

    Timing sees device work: on CUDA a pair of events per step (read at the rebalance, when
    the step's host read has synchronized anyway), on CPU the host clock."""

    def __init__(self, split: list[int], batch: int, unit: int, dp_rank: int, every: int = EVERY,
                 device=None, group=None):
        check_split(split, batch, unit)
        if every < 1:
            raise ValueError(f"--batch-split-every must be >= 1, got {every}")
        self.split, self.batch, self.unit, self.every = list(split), batch, unit, every
        self.dp_rank, self.device, self.group = dp_rank, device, group
        self.window: list = []  # (start, end, waited s, samples) of the measured steps
        self.skip = SETTLE
        self.last: dict | None = None  # the last rebalance: step, measurements, old/new split
        self._t0 = None

    def _now(self):
        if self.device is not None and self.device.type == "cuda":
            import torch
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def begin(self) -> None:
        self._t0 = self._now()

    def end(self, waited: float, samples: int) -> None:
        """After this step's forward + backward: `waited`, the seconds of it spent waiting on
        communication; `samples`, the rows this rank ran."""
        t1 = self._now()
        if self.skip > 0:
            self.skip -= 1
            return
        self.window.append((self._t0, t1, waited, samples))

    @staticmethod
    def _seconds(t0, t1) -> float:
        if isinstance(t0, float):
            return t1 - t0
        t1.synchronize()
        return t0.elapsed_time(t1) / 1e3

    def measured(self) -> float:
        """This rank's median compute seconds per sample over the window (nan if empty)."""
        per = [max(self._seconds(a, b) - w, 0.0) / n for a, b, w, n in self.window]
        return statistics.median(per) if per else math.nan

    def step(self, step: int) -> list[int] | None:
        """Collective every `every` steps (every rank of the group calls it each step)."""
        if step % self.every:
            return None
        import torch
        import torch.distributed as dist
        mine = torch.tensor([float(self.dp_rank), self.measured()], dtype=torch.float64,
                            device=self.device)
        world = dist.get_world_size(self.group)
        got = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=self.group)
        secs = [0.0] * len(self.split)
        for rank, s in torch.stack(got).tolist():  # the replica's slowest member; nan sticks
            r = int(rank)
            secs[r] = math.nan if math.isnan(s) or math.isnan(secs[r]) else max(secs[r], s)
        self.window = []
        new = propose(self.split, secs, self.batch, self.unit)
        self.last = {"step": step, "secs_per_sample": secs, "old": self.split, "new": new}
        if new == self.split:
            return None
        self.split = new
        return new


# ---------------------------------------------------------------- the job's side (Job calls these)
def apply(job, split: list[int]) -> None:
    """Install `split` from the next step on: the job's split (the logged loss's weights, the
    record, validation), this rank's samples= on its reducer, and its rows of each global
    batch (Batches.resplit: the same global batches, from the next one on)."""
    job.split = list(split)
    reducer = job.dp if job.dp is not None else job.zero
    if reducer is not None:
        reducer.samples = split[job.mesh.dp_rank]
    job.batches.resplit(job.split)
    if job.balancer is not None:
        job.balancer.split, job.balancer.window = list(split), []  # measured at the new sizes


def after_step(job, step: int, rec: dict) -> None:
    """Every rank, after each step's record is made (it logs the split that step ran): the
    rebalance when due (a collective every --batch-split-every steps)."""
    if job.balancer is None:
        return
    new = job.balancer.step(step)
    if step % job.balancer.every == 0:  # what the rebalance saw, and the split it chose
        rec["rebalance"] = {"secs_per_sample": job.balancer.last["secs_per_sample"],
                            "next": job.balancer.last["new"]}
    if new is not None:
        apply(job, new)


def restore(job, saved) -> str | None:
    """A resumed run's split: the checkpoint's (`saved`, its "train" record's batch_split)
    where it fits this run (--batch-split auto, the same dp size, --batch and unit), else the
    even split. Returns the line that says which (None: not auto)."""
    if job.balancer is None:
        return None
    b = job.balancer
    start = even(b.batch, len(b.split), b.unit)
    why = None
    if saved is None:
        why = "the checkpoint holds no split"
    elif len(saved) != len(start):
        why = f"its split {list(saved)} is for {len(saved)} dp ranks, this run has {len(start)}"
    else:
        try:
            check_split(saved, b.batch, b.unit)
        except ValueError as e:
            why = f"its split does not fit: {e}"
    if why is not None:
        apply(job, start)
        return f"--batch-split auto: {why}; starting again from the even split {start}"
    apply(job, saved)
    return f"--batch-split auto: continuing with the checkpoint's split {list(saved)}"
