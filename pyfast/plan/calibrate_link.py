"""Calibration probes of the link (pyfast.plan.calibrate): the latency/bandwidth fits of 2
gloo ranks on loopback or in a shaped namespace, top-k's and PowerSGD's per-parameter
calls, the wake-up of a blocking wait; and the launcher of the probes' child ranks."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from .timing_reduce import PER_PARAM  # DataParallel reduces these a parameter at a time

REPEATS = 5   # median of 5 after a warm call: the 2-core machine's noise is ~5-10% per call
# probes timed in rounds (reduce_seconds, calibrate_dist: zero / tp / cp / pp): rounds for ~PROBE_S
# seconds, at least their floor, at most MAX_REPEATS (a top-k chain of 8 calls takes ~12 ms at
# 100 Mbit/s: 41 rounds of 3 in ~1.5 s; gpt-tiny's step ~15 ms: 41 rounds of 4 configs in ~3 s)
PROBE_S, MAX_REPEATS = 3.0, 41


def rounds(round_s: float, floor: int, budget_s: float = PROBE_S) -> int:
    """How many rounds of round_s seconds fit budget_s, within [floor, MAX_REPEATS]: rank 0's
    count on every rank (each rank timed its own warm rounds; both must run as many)."""
    import torch
    import torch.distributed as dist
    n = torch.tensor([min(MAX_REPEATS, max(floor, int(budget_s / max(round_s, 1e-9))))])
    dist.broadcast(n, 0)
    return int(n)


def reduce_seconds(specs, hidden: int = 64, chain: int = 8, repeats: int = REPEATS,
                   budget_s: float = PROBE_S) -> dict:
    """{spec: [a, b, vector_s]}: seconds = a + b x elements of one compressed all-reduce of a
    matrix parameter, vector_s: of a vector (PowerSGD all-reduces those uncompressed)
    (pyfast.comm.collectives.all_reduce with the compressor and its error feedback, as
    DataParallel reduces top-k's and PowerSGD's parameters one by one on its thread), timed
    as a chain of `chain` such calls back to back (median of the chains, the max over ranks)
    on hidden x hidden and hidden x 4 hidden matrices and a vector, the three chains in turn
    round after round (a and b come from the difference of two: each round's pair ran under
    the same load), as many rounds as `budget_s` allows (`repeats` to MAX_REPEATS). Each
    parameter's call is a few dependent collectives with codec work and helper-thread
    hand-offs between them: gpt-tiny's 29 parameters under topk:0.01 stepped in 64-106 ms at
    1 Gbit/s and 100 Mbit/s against 36-45 ms from the latency fit + codec, i.e. ~1.5-3 ms a
    parameter, not the 0.4 ms that two back-to-back calls cost. Why rounds and a budget:
    with 10 chains a shape, one after the other, top-k's call at 100 Mbit/s came out
    a = 1.3-2.9 ms and b = 0-95 ns an element over eight plan_time runs (session 52: its run
    predicted -12% to +65%)."""
    import torch
    import torch.distributed as dist
    import pyfast.compress as C
    from pyfast.comm import collectives
    out = {}
    shapes = (hidden, 4 * hidden, 0)  # 0: a vector (a bias, a norm's weight)
    for spec in sorted({s for s in specs if s.partition(":")[0] in PER_PARAM}):
        c = C.wrap(C.get(spec))
        xs = {cols: [torch.randn(hidden, cols) if cols else torch.randn(hidden + 7)
                     for _ in range(chain)] for cols in shapes}
        ts = {cols: [] for cols in shapes}

        def run(cols):
            dist.barrier()
            t0 = time.perf_counter()
            for k, x in enumerate(xs[cols]):
                collectives.all_reduce(x, c, name=f"probe{cols}.{k}")
            return (time.perf_counter() - t0) / chain

        t_warm = time.perf_counter()
        for cols in shapes:  # the first chain warms the feedback memories and compressor states
            run(cols)
        for _ in range(rounds(time.perf_counter() - t_warm, repeats, budget_s)):
            for cols in shapes:
                ts[cols].append(run(cols))
        pts = [(hidden * cols, statistics.median(ts[cols])) for cols in shapes]
        w = torch.tensor([t for _, t in pts], dtype=torch.float64)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        (n0, _), (n1, _), _ = pts
        t0_, t1_, vec = w.tolist()
        b = max(0.0, (t1_ - t0_) / (n1 - n0))
        out[spec] = [max(0.0, t0_ - b * n0), b, vec]
    return out


def link_probe(path: str, pause: bool, specs=()) -> None:
    """A rank of the link probe (env:// rendezvous, gloo): cost.measure_link, rank 0 writes
    {"fits", "small_s"} as JSON to `path`. Launched by measure() on loopback, and by
    pyfast.benchmarks.plan_time inside a shaped namespace."""
    import datetime
    import torch
    import torch.distributed as dist
    from pyfast.comm import cost
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    # thrice, keeping per primitive the fit that is faster at 256 KB: a probe's first calls
    # (and any taken while another process holds the cores) came out 10x slow, e.g. a 256 B
    # all-reduce at 3-4 ms against 0.3 ms, which then priced every tp and pp call
    # (three: a loopback probe's 16 B all-reduce came out 3.19 ms in both of two, 0.19 /
    # 3.2 / 1.38 in three back to back, 2026-11-28, with other work niced on the cores)
    fits = [cost.measure_link(pause=pause) for _ in range(3)]
    best = {p: min((lm.fits[p] for lm in fits),
                   key=lambda f: f[0] + f[1] * max(0.0, (1 << 18) - f[2]))
            for p in cost.PRIMITIVES}
    # each primitive's latency: the faster probe's 256 B call (a slow first probe priced a
    # 2-rank 256 B all-reduce at 100 Mbit/s at 1.9 ms against 0.66 ms in another run)
    best = {p: [min(lm.fits[p][0] for lm in fits), *f[1:]] for p, f in best.items()}
    small = min(lm.small_s for lm in fits)
    # a 256 B and a 16 B all-reduce are the same call (one packet each way): the faster of
    # the two timings is its latency (a loopback probe under load timed the 256 B one at
    # 2.8 ms and the 16 B one at 0.24 ms, which priced PowerSGD's step +195%)
    best["all_reduce"][0] = min(best["all_reduce"][0], small)
    # each work's median of three tables: one table came out 0-0.25 ms, the next 0.4-6 ms
    tables = [wake_seconds() for _ in range(3)]
    wake = [[w, statistics.median(t[i][1] for t in tables)] for i, (w, _) in
            enumerate(tables[0])]
    # the median of 10 chains, not the faster of two probes: a chain's time is what the job's
    # thread meets (0.3-3 ms a top-k call from one chain to the next here), and the faster of
    # two probes priced gpt-tiny's top-k step at 35 ms against 59 measured
    per_tensor = reduce_seconds(specs, repeats=2 * REPEATS)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps({"fits": {k: list(v) for k, v in best.items()},
                                          "small_s": small, "wake_s": wake,
                                          "reduce": per_tensor}))
    _finish()


# compute before the wait: tp's half block .. a stage .. a whole step since the ranks last met
# (DataParallel's final wait: gpt-tiny's dp2 waited 5.7-8.2 ms after ~9 ms of compute where
# the table, held at its 3 ms end, gave 0-1.6)
WORKS = (0.1e-3, 0.3e-3, 1e-3, 3e-3, 10e-3, 30e-3)


def wake_seconds(works=WORKS, repeats: int = 15) -> list[list[float]]:
    """[[work_s, extra_s], ...]: the extra seconds of a blocking collective that follows
    work_s of compute, over the same call back to back (timed here first): the waiting rank's thread
    sleeps, its (virtual) core idles, and waking it costs this much. Measured here with 2
    gloo ranks: per-call medians of 0.2-2 ms against 0.3 ms back to back, varying from one
    probe to the next and with the work before the call, so each work's mean (10% trimmed
    each side) is kept. The job pays it at every blocking wait: tp's all-reduces, pp's
    receives, the step's small all-reduce, DataParallel's final wait."""
    import time
    import torch
    import torch.distributed as dist
    a, x = torch.randn(64, 64), torch.zeros(4)
    out = []
    for _ in range(3):
        dist.all_reduce(x)
    back = []
    for _ in range(repeats):
        t = time.perf_counter()
        dist.all_reduce(x)
        back.append(time.perf_counter() - t)
    for work_s in works:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < work_s:  # how many matmuls make work_s here
            a @ a
            n += 1
        ts = []
        for _ in range(repeats):
            for _ in range(n):
                a @ a
            t = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t)
        ts.sort()
        cut = len(ts) // 10
        out.append(statistics.mean(ts[cut:len(ts) - cut]))
    w = torch.tensor(out + [statistics.median(back)], dtype=torch.float64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    w = w.tolist()
    return [[work_s, max(0.0, v - w[-1])] for work_s, v in zip(works, w)]


def probe_argv(path: str, pause: bool, specs=()) -> list[str]:
    return ["-c", "from pyfast.plan.calibrate_link import link_probe; "
            f"link_probe({path!r}, {pause}, {sorted(set(specs))!r})"]


def probe_link(link: str, timeout: float = 180, specs=()) -> dict:
    """The link model of 2 gloo ranks inside a fresh namespace whose loopback is shaped to
    `link` ("1gbit", "100mbit": pyfast.netns, as pyfast.ablate runs its cells; needs
    root), pausing before its large calls as steps do (a token bucket refills between them)."""
    from pyfast import netns
    netns.rate_bps(link)  # a bad link string fails before anything starts
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "link.json")
        netns.run_ranks(probe_argv(path, True, specs), 2, link, timeout)
        fit = json.loads(Path(path).read_text())
    # the bucket itself (timing.Link._bucket_s): tc's rate in bytes/s and its burst
    fit["tbf"] = [netns.rate_bps(link) / 8, netns.BURST_BYTES]
    return fit


def measure_loopback_link(timeout: float = 120, specs=()) -> dict:
    """The link model of 2 gloo ranks on plain loopback (2 child processes)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "link.json")
        _child(probe_argv(path, False, specs), timeout, world=2)
        return json.loads(Path(path).read_text())


def _finish() -> None:
    """A probe rank's end: a barrier, then destroy_process_group. Without the barrier a rank
    tore its gloo pairs down while its peer was still finishing the last collective, and both
    ranks died of SIGABRT ("terminate called without an active exception", the tp probe in the
    fresh-clone CI of 2026-11-29, once; 0 of 60 reruns here)."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def _child(argv: list[str], timeout: float, world: int = 1) -> None:
    """`python -c CODE` (argv = ["-c", CODE]) as `world` ranks of one gloo group (env://) on
    loopback, forked from the probes' server (pyfast.plan.probe_ranks)."""
    from . import probe_ranks
    flag, code = argv
    assert flag == "-c", argv
    codes = probe_ranks.run(code, world, timeout)
    if any(c != 0 for c in codes):
        raise RuntimeError(f"{code[:80]}: exit codes {codes} (None: still running after "
                           f"{timeout:g} s, killed)")
