"""Tensor parallelism on CPU ranks (`pyfast bench tp`): a transformer MLP block, forward and
backward, on 2 ranks against torch DTensor tensor parallel and against one process.

Block: x [tokens, hidden] -> Linear(hidden, mlp) -> GELU -> Linear(mlp, hidden); weights from one
seed on every rank; the step is forward + backward with a fixed upstream gradient, and x needs
its gradient too (the block sits inside a model). Variants, all in one launch and interleaved
round-robin in every repeat so that the drifting load of a shared machine falls on all alike:
  1 process x 1 thread       the dense block on rank 0 while rank 1 waits (ideal TP: 2x this)
  1 process x 2 threads      the same on the machine's two cores
  DTensor TP                 torch parallelize_module: ColwiseParallel fc1, RowwiseParallel fc2
  DTensor TP+SP              the same with the input and output sharded on tokens
                             (ColwiseParallel(input_layouts=Shard(0)),
                             RowwiseParallel(output_layouts=Shard(0)))
  pyfast TP                  ColumnParallelLinear / RowParallelLinear .from_linear
  pyfast TP+SP               the same, sequence_parallel=True
  pyfast TP+SP+overlap       the same, overlap=True: the sequence all-gather / reduce-scatter
                             in pieces overlapped with the GEMMs (pyfast.parallel.async_tp)
Each sample runs back-to-back steps for ~0.1 s (one step of the big block, ~7 of the small).
Each variant's output, input gradient and weight gradients are checked against the dense
block once before timing; a variant that disagrees is reported and not timed. Step time is the
slowest rank's (ranks leave a barrier together); a step ends when its output and its input
gradient are ready. On an emulated link (netns + tbf, see netns.py)
rank 0 also counts the bytes that crossed the namespace's lo per step.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import pyfast
from pyfast import perf
from pyfast._io import atomic_write_text
from pyfast import netns

SHAPES = {"big": (1024, 4096, 2048), "small": (256, 1024, 256),  # hidden, mlp, tokens
          "tiny": (64, 256, 64)}  # the CI size (bench/test_bench_tp.py)
DENSE = ["1 process x 1 thread", "1 process x 2 threads"]
VARIANTS = DENSE + ["DTensor TP", "DTensor TP+SP", "pyfast TP", "pyfast TP+SP",
                    "pyfast TP+SP+overlap"]
LINKS = ("loopback", "10gbit", "1gbit")
# fp32 sums split across ranks (and chunks) differ from the dense block's in rounding only
RTOL = ATOL = 1e-4
SAMPLE_S = 0.1  # a timed sample runs back-to-back steps for about this long (--steps 0)


def block(hidden: int, mlp: int, seed: int = 0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Linear(mlp, hidden))


def inputs(hidden: int, tokens: int, seed: int = 1):
    """(x, upstream gradient), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g)


# -- inside a rank process -------------------------------------------------------------------
class Case:
    """One variant on this rank: its module, its local input and upstream gradient, and how its
    tensors relate to the dense block's (`seq`: x and out sharded on tokens; `shards`: param
    name -> dim it is split on, None = whole)."""

    def __init__(self, module, x, gy, seq=False, shards=None, ranks=(0, 1), threads=1):
        self.module, self.gy, self.seq, self.shards = module, gy, seq, shards or {}
        self.x = x.detach().clone().requires_grad_(True)
        self.ranks, self.threads, self.out = ranks, threads, None
        self.info = ""  # how the variant was configured, for the table

    def zero_grad(self):
        self.module.zero_grad(set_to_none=True)
        self.x.grad = None

    def step(self):
        # a step ends when the next layer could use its output and the previous one its input
        # gradient: DTensor returns both as AsyncCollectiveTensors whose collectives may still
        # be in flight (TP+SP's last reduce-scatter is, on gloo), so wait for them here
        self.out = self.module(self.x)
        _wait(self.out)  # keep the wrapper: it carries the autograd graph
        self.out.backward(self.gy)
        self.x.grad = _wait(self.x.grad)


def _wait(t):
    """t's data once its pending collective (if any) has completed."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


def _local(t, dim, rank, world):
    return t if dim is None else t.chunk(world, dim)[rank]


def _check(case: Case, ref: dict, rank: int, world: int) -> str | None:
    """None if this rank's output and gradients match the dense block's, else what differs."""
    from torch.distributed.tensor import DTensor
    seq = 0 if case.seq else None
    got = {"output": case.out.detach(), "x.grad": case.x.grad}
    want = {"output": _local(ref["output"], seq, rank, world),
            "x.grad": _local(ref["x.grad"], seq, rank, world)}
    for name, p in case.module.named_parameters():
        if isinstance(p.grad, DTensor):  # DTensor resolves shards and partial sums itself
            got[name], want[name] = p.grad.full_tensor(), ref[name]
        else:
            got[name] = p.grad
            want[name] = _local(ref[name], case.shards.get(name), rank, world)
    for name, w in want.items():
        try:
            torch.testing.assert_close(got[name], w, rtol=RTOL, atol=ATOL)
        except (AssertionError, TypeError) as e:
            return f"rank {rank} {name}: " + " ".join(str(e).split())[:300]
    return None


def _dtensor(hidden, mlp, x, gy, rank, world, seq: bool) -> Case:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (world,))
    if seq:
        plan = {"0": ColwiseParallel(input_layouts=Shard(0)),
                "2": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    m = parallelize_module(block(hidden, mlp), mesh, plan)
    if seq:
        x, gy = x.chunk(world, 0)[rank], gy.chunk(world, 0)[rank]
    return Case(m, x, gy, seq=seq)


def _pyfast(hidden, mlp, x, gy, rank, world, seq: bool, overlap: bool = False) -> Case:
    from pyfast.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    m = block(hidden, mlp)
    kw = {"group": dist.group.WORLD, "sequence_parallel": seq, "overlap": overlap}
    m[0] = ColumnParallelLinear.from_linear(m[0], **kw)
    m[2] = RowParallelLinear.from_linear(m[2], **kw)
    if seq:
        x, gy = x.chunk(world, 0)[rank], gy.chunk(world, 0)[rank]
    case = Case(m, x, gy, seq=seq, shards={"0.weight": 0, "0.bias": 0, "2.weight": 1})
    case.info = f"{m[0].pieces} pieces" if overlap else ""
    return case


BUILD = {
    "1 process x 1 thread": lambda h, m, x, gy, r, w: Case(block(h, m), x, gy, ranks=(0,)),
    "1 process x 2 threads": lambda h, m, x, gy, r, w: Case(block(h, m), x, gy, ranks=(0,),
                                                          threads=2),
    "DTensor TP": lambda *a: _dtensor(*a, seq=False),
    "DTensor TP+SP": lambda *a: _dtensor(*a, seq=True),
    "pyfast TP": lambda *a: _pyfast(*a, seq=False),
    "pyfast TP+SP": lambda *a: _pyfast(*a, seq=True),
    "pyfast TP+SP+overlap": lambda *a: _pyfast(*a, seq=True, overlap=True),
}


def _pin(cores: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):  # every thread: torch's, OpenMP's, gloo's I/O
        os.sched_setaffinity(int(tid), cores)


def _timed_steps(case: Case, rank: int, steps: int = 1, pinned: bool = False) -> float:
    """Seconds per step of `steps` back-to-back steps (each from zeroed gradients)."""
    if rank not in case.ranks:
        return 0.0  # waits at the next barrier while the dense block runs on rank 0
    if pinned and case.threads > 1:
        _pin(set(range(os.cpu_count())))
    torch.set_num_threads(case.threads)
    t0 = perf.clock(case.x.device)
    for _ in range(steps):
        case.zero_grad()
        case.step()
    dt = (perf.clock(case.x.device) - t0) / steps
    torch.set_num_threads(1)
    if pinned and case.threads > 1:
        _pin({rank % os.cpu_count()})
    return dt


def _steps_per_sample(warm: list[float], job: dict) -> int:
    """Steps per timed sample: job["steps"], or (0 = auto) enough for SAMPLE_S by the warm-up's
    median step, so that a ~10 ms step's scheduling jitter (a wake-up, a descheduled gloo
    thread) is averaged inside each sample rather than deciding the median."""
    if job["steps"]:
        return job["steps"]
    return max(1, round(SAMPLE_S / statistics.median(warm))) if warm else 1


def _measure(shape: str, job: dict, rank: int, world: int) -> dict | None:
    """Verify then time every variant of one shape; the slowest rank's step, on rank 0."""
    hidden, mlp, tokens = SHAPES[shape]
    x, gy = inputs(hidden, tokens)
    dense = Case(block(hidden, mlp), x, gy)
    dense.step()
    ref = {"output": dense.out.detach(), "x.grad": dense.x.grad,
           **{n: p.grad for n, p in dense.module.named_parameters()}}
    cases, problems = {}, {}
    for name in job["variants"]:
        try:
            c = BUILD[name](hidden, mlp, x, gy, rank, world)
            c.zero_grad()
            dist.barrier()
            _timed_steps(c, rank, 1, job["pin"])
            problem = None if rank not in c.ranks else _check(c, ref, rank, world)
        except Exception as e:  # noqa: BLE001  (a variant that cannot run is reported, not fatal)
            c, problem = None, f"rank {rank}: {type(e).__name__}: {e}"
        each = [None] * world
        dist.all_gather_object(each, problem)
        if any(each):  # every rank drops it, so the collectives stay matched
            problems[name] = "; ".join(p for p in each if p)
        else:
            cases[name] = c
    load0 = os.getloadavg()[0]
    warm = []
    for _ in range(job["warmup"]):
        for c in cases.values():
            dist.barrier()
            dt = _timed_steps(c, rank, 1, job["pin"])
            warm += [dt] if rank in c.ranks else []
    steps = [_steps_per_sample(warm, job)]
    dist.broadcast_object_list(steps, src=0)  # rank 0 decides, every rank runs as many
    steps = steps[0]
    times = {n: [] for n in cases}
    sent = {n: [] for n in cases}
    count = bool(os.environ.get("PYFAST_NETNS")) and rank == 0
    for _ in range(job["repeats"]):
        for name, c in cases.items():
            dist.barrier()
            b0 = netns.lo_tx_bytes() if count else 0
            times[name].append(_timed_steps(c, rank, steps, job["pin"]))
            if count:
                sent[name].append((netns.lo_tx_bytes() - b0) / steps)
    each = [None] * world
    dist.all_gather_object(each, times)
    if rank != 0:
        return None
    rows = []
    for name in job["variants"]:
        if name in problems:
            rows.append({"variant": name, "problem": problems[name]})
            continue
        per_step = [max(ts) for ts in zip(*(e[name] for e in each))]
        rows.append({"variant": name, "info": cases[name].info, **perf.summary(per_step),
                     "lo_bytes": statistics.median(sent[name]) if count else None})
    return {"shape": shape, "hidden": hidden, "mlp": mlp, "tokens": tokens,
            "steps_per_sample": steps, "load_average": [load0, os.getloadavg()[0]], "rows": rows}


def _worker() -> None:
    """One rank: env as torchrun sets it, the job in PYFAST_TP (json)."""
    job = json.loads(os.environ["PYFAST_TP"])
    torch.set_num_threads(1)  # one core per rank; the machine has 2
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    if job["pin"]:
        _pin({rank % os.cpu_count()})
    blocks = [_measure(s, job, rank, world) for s in job["shapes"]]
    if rank == 0:
        atomic_write_text(job["out"], json.dumps(blocks))
    # DTensor TP+SP leaves functional-collective works referenced from its modules' tensors;
    # freed after the group is destroyed they abort the rank ("terminate called without an
    # active exception", 1 run in 8 of the tiny block): free them first, then leave together.
    gc.collect()
    dist.barrier()
    netns.finish_group()


# -- the driver (parent process) ---------------------------------------------------------------
def wire_bytes(hidden: int, tokens: int, world: int = 2) -> int:
    """The fewest bytes all ranks can send per step, plain or sequence parallel alike: forward
    and backward each move one [tokens, hidden] fp32 activation through an all-reduce (a ring:
    2(W-1)/W of it per rank) or an all-gather plus a reduce-scatter ((W-1)/W each). gloo's
    reduce_scatter_single sends an all-reduce's worth (measured on the namespace's lo: 0.50 MB
    for a 256 KB input at W=2, a ring needs 0.25 MB), so its TP+SP steps send 1.5x this."""
    return 2 * 2 * (world - 1) * tokens * hidden * 4


def run(links=("loopback",), shapes=("big", "small"), variants=VARIANTS, repeats: int = 7,
        warmup: int = 2, steps: int = 0, pin: bool = False, timeout: float = 1800,
        log=print) -> dict:
    blocks = []
    for link in links:
        bps = netns.rate_bps(link)  # a bad link string fails before anything runs
        with tempfile.TemporaryDirectory() as d:
            job = {"shapes": list(shapes), "variants": list(variants), "repeats": repeats,
                   "warmup": warmup, "steps": steps, "pin": pin, "timeout": timeout,
                   "out": os.path.join(d, "r.json")}
            try:
                netns.run_ranks(["-c", "from pyfast.benchmarks.tp import _worker; _worker()"],
                                2, link, timeout, env={"PYFAST_TP": json.dumps(job)})
            except netns.LinkUnavailable as e:
                blocks.append({"link": link, "skipped": str(e)})
                log(f"skipped {link}: {e}")
                continue
            with open(job["out"]) as f:
                got = json.load(f)
        for b in got:
            b["link"] = link
            wire = wire_bytes(b["hidden"], b["tokens"])
            b["wire_bytes"], b["floor_s"] = wire, (wire * 8 / bps if bps else None)
            _ratios(b["rows"])
        blocks += got
        log(f"done: {link}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' setting, for the machine line
    machine = perf.machine()
    torch.set_num_threads(threads)
    result = {"machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "pyfast": pyfast.__version__, "torch": torch.__version__, "world": 2,
              "repeats": repeats, "warmup": warmup, "pinned": pin, "cores": os.cpu_count(),
              "links": {k: netns.rate_bps(k) for k in links}, "blocks": blocks}
    result["targets"] = targets(result)
    return result


# which DTensor row a pyfast row is measured against: the same layout
PEER = {"pyfast TP": "DTensor TP", "pyfast TP+SP": "DTensor TP+SP",
        "pyfast TP+SP+overlap": "DTensor TP+SP"}


def _ratios(rows: list[dict]) -> None:
    t = {r["variant"]: r["median_s"] for r in rows if "median_s" in r}
    for r in rows:
        if "median_s" not in r:
            continue
        one = t.get(DENSE[0])
        r["vs_1_thread"] = one / r["median_s"] if one else None
        peer = t.get(PEER.get(r["variant"], ""))
        r["vs_dtensor"] = peer / r["median_s"] if peer else None


def _time(result, link, shape, variant):
    for b in result["blocks"]:
        if b.get("link") == link and b.get("shape") == shape:
            return next((r.get("median_s") for r in b["rows"] if r["variant"] == variant), None)
    return None


def targets(result: dict) -> list[dict]:
    """Issue 4's targets, each with the measured value; a target whose rows were not measured
    is left out (say so by its absence, never by a guess)."""
    out = []

    def add(what, value, goal, ok):
        out.append({"target": what, "measured": value, "goal": goal, "met": bool(ok)})
    pyf = [v for v in VARIANTS if v.startswith("pyfast")]
    t = lambda link, shape, v: _time(result, link, shape, v)  # noqa: E731
    one = t("loopback", "big", DENSE[0])
    best = min(((t("loopback", "big", v), v) for v in pyf if t("loopback", "big", v)),
               default=None)
    if one and best:
        x = one / best[0]
        add(f"loopback big: best pyfast ({best[1]}) vs 1 process x 1 thread", f"{x:.2f}x",
            ">= 1.8x", x >= 1.8)
    for shape in ("big", "small"):
        for v in pyf:
            mine, peer = t("loopback", shape, v), t("loopback", shape, PEER[v])
            if mine and peer:
                x = mine / peer
                add(f"loopback {shape}: {v} / {PEER[v]} time", f"{x:.3f}", "<= 1.03", x <= 1.03)
    mine = t("1gbit", "big", "pyfast TP+SP+overlap")
    peers = [(t("1gbit", "big", v), v) for v in ("DTensor TP", "DTensor TP+SP")]
    peers = [p for p in peers if p[0]]
    if mine and peers:
        peer = min(peers)
        x = peer[0] / mine
        add(f"1gbit big: pyfast TP+SP+overlap vs the faster DTensor ({peer[1]})", f"{x:.2f}x",
            ">= 1.2x", x >= 1.2)
    return out


def table(result: dict):
    t = perf.rich_table(
        "tensor-parallel MLP block x -> Linear(h, m) -> GELU -> Linear(m, h), forward + backward, "
        f"{result['world']} ranks x 1 thread; median of {result['repeats']} samples after "
        f"{result['warmup']} warm-up steps, slowest rank", result,
        ("link", "block", "variant", "step ms", "q10-q90", "vs 1 thread", "vs DTensor",
         "lo MB/step", "floor ms"), left=("link", "block", "variant"), no_wrap=True)
    skipped = []
    for b in result["blocks"]:
        if "skipped" in b:
            skipped.append(f"{b['link']}: not run, {b['skipped']}")
            continue
        for i, r in enumerate(b["rows"]):
            first = {0: (b["link"], f"{b['shape']}: h={b['hidden']} m={b['mlp']} "
                                    f"tokens={b['tokens']}"),
                     1: ("", f"load {b['load_average'][0]:.1f}-{b['load_average'][1]:.1f}"),
                     2: ("", f"{b['steps_per_sample']} step(s) per sample")}
            link, label = first.get(i, ("", ""))
            last = i == len(b["rows"]) - 1
            if "problem" in r:
                t.add_row(link, label, r["variant"], "not timed", end_section=last)
                skipped.append(f"{b['link']} {b['shape']} {r['variant']}: not timed, "
                               f"{r['problem']}")
                continue
            x = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
            dist_row = r["variant"] not in DENSE
            name = r["variant"] + (f" ({r['info']})" if r.get("info") else "")
            t.add_row(link, label, name, f"{r['median_s'] * 1e3:.1f}",
                      f"{r['q10_s'] * 1e3:.1f}-{r['q90_s'] * 1e3:.1f}", x(r["vs_1_thread"]),
                      x(r["vs_dtensor"]),
                      "" if r["lo_bytes"] is None or not dist_row else f"{r['lo_bytes'] / 2**20:.2f}",
                      "" if b["floor_s"] is None or not dist_row else f"{b['floor_s'] * 1e3:.1f}",
                      end_section=last)
    t.caption_justify = "left"
    t.caption = "\n".join(
        skipped + [f"{'met   ' if x['met'] else 'MISSED'} {x['target']}: {x['measured']} "
                   f"(target {x['goal']})" for x in result["targets"]]
        + ["vs DTensor: the DTensor row with the same layout (TP or TP+SP) / this row. "
           "lo MB/step: bytes that crossed the namespace's lo by the end of the step (emulated "
           "links only). floor: the fewest bytes / link rate (4 (W-1) tokens h fp32 per step; "
           "gloo's reduce-scatter sends 2x a ring's, so TP+SP sends 1.5x); load: 1-minute load "
           "average at the start and end of the block (2.0 = both cores busy)"]
        + ([f"note: {result['note']}"] if result.get("note") else []))
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench tp", description=__doc__.split("\n")[0])
    p.add_argument("--link", default="all", help="loopback, 10gbit, 1gbit or all (default), "
                                                 "or comma-separated tc rates")
    p.add_argument("--shape", default="all", help="big, small, tiny or all (= big,small)")
    p.add_argument("--variants", default="", help="comma-separated (default: all)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=0,
                   help="steps per timed sample (default 0: enough for ~0.1 s, by the warm-up)")
    p.add_argument("--pin", action="store_true",
                   help="pin rank r's threads to core r (the 2-thread block gets both cores)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per link")
    p.add_argument("--note", default="", help="recorded with the results (e.g. 'under load')")
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    links = LINKS if a.link == "all" else tuple(a.link.split(","))
    shapes = ("big", "small") if a.shape == "all" else tuple(a.shape.split(","))
    variants = a.variants.split(",") if a.variants else VARIANTS
    try:
        [netns.rate_bps(k) for k in links]
    except ValueError as e:
        p.error(str(e))
    if bad := [s for s in shapes if s not in SHAPES] + [v for v in variants if v not in BUILD]:
        p.error(f"unknown shape or variant: {', '.join(bad)}")
    if a.repeats < 1 or a.warmup < 0 or a.steps < 0:
        p.error("--repeats must be >= 1, --warmup and --steps >= 0")
    res = run(links, shapes, variants, a.repeats, a.warmup, a.steps, a.pin, a.timeout)
    res["note"] = a.note
    return perf.finish(res, table, a.out, width=170)


if __name__ == "__main__":
    raise SystemExit(main())
