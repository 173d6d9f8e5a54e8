"""Pipeline parallelism on CPU ranks (`pyfast bench pipeline`): pyfast's schedules against
torch.distributed.pipelining's and against one process doing the same training step.

Model: 8 x (Linear(w) + ReLU), MSE loss, 8 micro-batches; "large" w=1024 batch 256, "tiny" w=256
batch 32. Providers, all in one launch and interleaved round-robin in every repeat so that the
drifting load of a shared machine falls on all of them alike:
  1 process, whole batch     one forward/backward on the whole batch, 1 or 2 torch threads
  1 process, 8 micro-batches the pipeline's job in one process: 8 micro-batches, gradients summed
  pyfast <schedule>          Pipeline.step on p ranks, one thread each
  torch <Schedule>           torch.distributed.pipelining on the same stages
Ranks are pinned one per core (rank r on core r % cores), as `taskset` would in a launcher: on
2 busy cores gloo's I/O thread otherwise waits for a core, and a transfer costs ~1 ms instead of
~0.1 ms. Step time is the slowest rank's (ranks start together after a barrier). "In a loop":
`--loop` steps in a row per provider, as a training loop runs them (the first rank's start to
the last rank's end, / steps): a single step after a barrier also pays the ranks' uneven exit
from the barrier and a cold start, and pyfast's ranks end a step together (they agree on its
outcome) where torch's end one by one. pyfast rows also report the bubble, 1 - sum(compute) / (p
x step), the scheduling overhead per action, (step - compute - waiting) / actions, and the peak
activation bytes of a traced step.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pyfast
from pyfast import perf
from pyfast import netns

MODELS = {"large": (1024, 256), "tiny": (256, 32)}
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1}  # name: virtual stages
TORCH = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
         "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
         "zb-h1": ("ScheduleInterleavedZeroBubble", 1)}  # ZB1P with one stage per rank
M = 8
_local: dict = {}  # inside a rank process: provider name -> (module, step function)
_batch: list = []  # inside a rank process: this model's (x, target)


def model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(width, width), nn.ReLU())])


def batch(width: int, rows: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def single_process(width: int, rows: int, threads: int, micro: bool):
    """One step of the same model in this process: whole batch, or the pipeline's micro-batches."""
    seq, (x, t) = model(width), batch(width, rows)

    def step():
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        seq.zero_grad(set_to_none=True)
        if not micro:
            F.mse_loss(seq(x), t).backward()
        else:
            for xc, tc in zip(x.chunk(M), t.chunk(M)):
                (F.mse_loss(seq(xc), tc) / M).backward()
        torch.set_num_threads(old)
    return step


# -- inside the rank processes -------------------------------------------------------------------
def _pin(rank: int):
    cores = {rank % os.cpu_count()}
    for tid in os.listdir("/proc/self/task"):  # every thread: torch's and gloo's I/O thread
        os.sched_setaffinity(int(tid), cores)


def _start(pin: bool):
    torch.set_num_threads(1)
    if pin:  # after the process group exists: gloo's I/O thread is pinned too
        _pin(dist.get_rank())


def _setup(width, rows):
    from torch.distributed import pipelining as tp

    from pyfast.parallel import Pipeline
    from pyfast.parallel.schedules import partition
    rank, world = dist.get_rank(), dist.get_world_size()
    _local.clear()
    x, t = batch(width, rows)
    _batch[:] = [x, t]
    first, last = rank == 0, rank == world - 1
    for name, v in SCHEDULES.items():
        pipe = Pipeline.from_sequential(model(width), M, name, F.mse_loss, virtual_stages=v)
        _local["pyfast " + name] = (pipe, lambda pipe=pipe: pipe.step(x if first else None,
                                                                       t if last else None))
    for name, (cls, v) in TORCH.items():
        seq, n = model(width), world * v
        counts = partition([sum(p.numel() for p in layer.parameters()) for layer in seq], n)
        bounds = [sum(counts[:s]) for s in range(n + 1)]
        stages = [tp.PipelineStage(seq[bounds[s]:bounds[s + 1]], s, n, torch.device("cpu"))
                  for s in range(rank, n, world)]
        sched = getattr(tp, cls)(stages[0] if cls in ("ScheduleGPipe", "Schedule1F1B") else stages,
                                 n_microbatches=M, loss_fn=F.mse_loss)
        mods = nn.ModuleList(st.submod for st in stages)

        def step(sched=sched):
            if first:
                sched.step(x)
            elif last:
                sched.step(target=t, losses=[])
            else:
                sched.step()
        _local["torch " + cls] = (mods, step)
    return list(_local)


def _round(names):
    """One step of each provider, in turn; per provider (seconds, pyfast stats or None)."""
    out = {}
    for name in names:
        mod, step = _local[name]
        mod.zero_grad(set_to_none=True)
        dist.barrier()
        dev = perf.device_of(mod)
        t0 = perf.clock(dev)
        step()
        out[name] = (perf.clock(dev) - t0, dict(getattr(mod, "last_stats", {})) or None)
    return out


def _loop(names, steps: int):
    """Per provider, (start, end) on this rank's clock (perf_counter: CLOCK_MONOTONIC, one
    clock for every process here) of `steps` steps in a row after a barrier, as a training loop
    runs them."""
    out = {}
    for name in names:
        mod, step = _local[name]
        mod.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        out[name] = (t0, time.perf_counter())
    return out


def _grad_sq(names):
    """Per provider, the squared norm of this rank's parameter gradients from its last step:
    summed over ranks, the whole model's, to compare with single_process(micro=True)'s."""
    return {n: float(sum(p.grad.double().pow(2).sum() for p in _local[n][0].parameters()
                         if p.grad is not None)) for n in names}


def _traced(name, path):
    from pyfast.parallel import save_trace
    rank, world = dist.get_rank(), dist.get_world_size()
    pipe, _ = _local["pyfast " + name]
    first, last = rank == 0, rank == world - 1
    x, t = _batch
    pipe.zero_grad(set_to_none=True)
    dist.barrier()
    pipe.step(x if first else None, t if last else None, trace=True)
    written = save_trace(path, title=f"pyfast {name}, {world} ranks") if path else None
    return pipe.last_stats["peak_activation_bytes"], written


@contextlib.contextmanager
def ranks(world: int, pin: bool = True, timeout: float = 600):
    """`world` live rank processes in one gloo group (netns.pool) that run this module's rank
    functions on request: `with ranks(2) as launch: launch.call(_setup, width, rows)`."""
    with netns.pool(world, timeout) as launch:
        launch.call(_start, pin)
        yield launch


# -- the driver (parent process) ---------------------------------------------------------------
def run(worlds=(2, 4), models=("large", "tiny"), repeats: int = 7, pin: bool = True,
        trace: str | None = None, log=print, loop: int = 0) -> dict:
    """Measure every provider; `trace` (a path prefix) also writes one traced pyfast 1f1b step
    of the first model at the first world size as PREFIX.json / PREFIX.png. loop > 0: also
    max(3, repeats // 4) rounds of `loop` steps in a row per provider (no barrier between
    them, as a training loop), the step time from the first rank's start to the last rank's
    end over the round, median over rounds."""
    runs, load = [], [os.getloadavg()[0]]
    for world in worlds:
        with ranks(world, pin) as launch:
            for mname in models:
                width, rows = MODELS[mname]
                load0 = os.getloadavg()[0]  # other jobs on the machine, for the record
                names = launch.call(_setup, width, rows)[0]
                singles = {f"1 process, {k}, {th} thread{'s' * (th > 1)}":
                           single_process(width, rows, th, micro)
                           for k, micro in (("whole batch", False), ("8 micro-batches", True))
                           for th in (1, 2)}
                times = {n: [] for n in [*singles, *names]}
                stats = {n: [] for n in names}
                launch.call(_round, names)  # warm-up: first-step shape exchange, allocator
                for f in singles.values():
                    f()
                for rep in range(repeats):
                    for n, f in singles.items():  # the ranks wait for their next call meanwhile
                        t0 = perf.clock()  # single_process: CPU modules only
                        f()
                        times[n].append(perf.clock() - t0)
                    per_rank = launch.call(_round, names)
                    for n in names:
                        times[n].append(max(r[n][0] for r in per_rank))
                        stats[n].append([r[n][1] for r in per_rank])
                looped = {n: [] for n in names}
                for _ in range(max(3, repeats // 4) if loop else 0):
                    per_rank = launch.call(_loop, names, loop)
                    for n in names:  # the first rank's start to the last rank's end
                        looped[n].append((max(r[n][1] for r in per_rank) -
                                          min(r[n][0] for r in per_rank)) / loop)
                rows_out = []
                for n, ts in times.items():
                    row = {"provider": n, **perf.summary(ts)}
                    if looped.get(n):
                        row["loop_step_s"] = statistics.median(looped[n])
                    if n.startswith("pyfast"):
                        sched = n.split()[1]
                        row.update(_pyfast_metrics(stats[n], world, SCHEDULES[sched]))
                        traced = trace and not runs and mname == models[0] and sched == "1f1b"
                        peaks = launch.call(_traced, sched, f"{trace}.json" if traced else None)
                        row["peak_activation_bytes"] = max(p for p, _ in peaks)
                    rows_out.append(row)
                base = {k: next(r["median_s"] for r in rows_out
                                if r["provider"] == f"1 process, {k}, 1 thread")
                        for k in ("whole batch", "8 micro-batches")}
                for r in rows_out:
                    r["vs_whole_1t"] = base["whole batch"] / r["median_s"]
                    r["vs_micro_1t"] = base["8 micro-batches"] / r["median_s"]
                runs.append({"world": world, "model": mname, "width": width, "batch": rows,
                             "load_average": [load0, os.getloadavg()[0]], "rows": rows_out})
                log(f"done: {world} ranks, {mname}")
    load.append(os.getloadavg()[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' setting, for the machine line
    machine = perf.machine()
    torch.set_num_threads(threads)
    result = {"machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "pyfast": pyfast.__version__, "torch": torch.__version__, "n_microbatches": M,
              "repeats": repeats, "loop": loop, "pinned": pin, "cores": os.cpu_count(),
              "load_average_start_end": load, "runs": runs}
    result["targets"] = targets(result)
    return result


def _row(result, world, model_name, provider):
    for r in result["runs"]:
        if r["world"] == world and r["model"] == model_name:
            return next((x for x in r["rows"] if x["provider"] == provider), None)
    return None


def targets(result: dict) -> list[dict]:
    """The issue's targets, each with the measured value (2 ranks unless said)."""
    out = []

    def add(what, value, goal, ok):
        out.append({"target": what, "measured": value, "goal": goal, "met": bool(ok)})
    big = lambda prov: _row(result, 2, "large", prov)  # noqa: E731
    tiny = lambda prov: _row(result, 2, "tiny", prov)  # noqa: E731
    one = big("pyfast 1f1b")
    if one:
        for base in ("8 micro-batches", "whole batch"):
            b1, b2 = big(f"1 process, {base}, 1 thread"), big(f"1 process, {base}, 2 threads")
            x1, x2 = b1["median_s"] / one["median_s"], b2["median_s"] / one["median_s"]
            add(f"large: 1f1b vs 1 process, {base}, 1 thread", f"{x1:.2f}x", ">= 1.6x", x1 >= 1.6)
            add(f"large: 1f1b vs 1 process, {base}, 2 threads", f"{x2:.2f}x", "> 1x", x2 > 1)
        for sched in ("gpipe", "1f1b"):
            r = big(f"pyfast {sched}")
            add(f"large: {sched} bubble", f"{r['bubble']:.3f} (formula {r['bubble_formula']:.3f})",
                "within 10%", abs(r["bubble"] / r["bubble_formula"] - 1) <= 0.1)
        gp = big("pyfast gpipe")
        ratio = one["peak_activation_bytes"] / gp["peak_activation_bytes"]
        add("large: 1f1b / gpipe peak activations", f"{ratio:.3f}", f"<= p/m = {2 / M:.3f}",
            ratio <= 2 / M)
    t1 = tiny("pyfast 1f1b")
    if t1:
        us = t1["overhead_per_action_s"] * 1e6
        add("tiny: 1f1b overhead per action", f"{us:.0f} us", "<= 100 us", us <= 100)
        for base in ("8 micro-batches", "whole batch"):
            b = tiny(f"1 process, {base}, 1 thread")
            x = t1["median_s"] / b["median_s"]
            add(f"tiny: 1f1b step / 1 process, {base}, 1 thread", f"{x:.2f}", "<= 1.2", x <= 1.2)
    return out


def _pyfast_metrics(per_step: list[list[dict]], world: int, v: int) -> dict:
    bubble = [1 - sum(s["compute"] for s in ranks) / (world * max(s["wall"] for s in ranks))
              for ranks in per_step]
    overhead = [max(s["overhead_per_action"] for s in ranks) for ranks in per_step]
    return {"bubble": statistics.median(bubble), "bubble_formula": (world - 1) / (v * M + world - 1),
            "overhead_per_action_s": statistics.median(overhead)}


def table(result: dict):
    from rich.table import Table
    t = Table(title=f"pipeline step, 8 x (Linear(w) + ReLU), MSE, {result['n_microbatches']} "
                    f"micro-batches; median of {result['repeats']}\n{result['machine']}; "
                    f"ranks {'pinned one per core' if result['pinned'] else 'unpinned'}")
    perf.columns(t, ("ranks", "model", "provider", "step ms", "q10-q90",
                     f"in a loop of {result.get('loop') or '-'}, ms/step",
                     "vs 1 process whole, 1 thread", "vs 1 process 8 mb, 1 thread",
                     "bubble (formula)", "overhead/action", "peak activations"),
                 left=("model", "provider"), no_wrap=True)
    t.caption = "targets: " + "; ".join(
        f"{x['target']} {x['measured']} ({x['goal']}: {'met' if x['met'] else 'missed'})"
        for x in result["targets"])
    t.caption += ("\nload: the machine's 1-minute load average at the start and end of each block "
                  "(2.0 = both cores busy before this benchmark adds its own work)")
    if result.get("note"):
        t.caption += f"\nnote: {result['note']}"
    for run_ in result["runs"]:
        for i, r in enumerate(run_["rows"]):
            bub = f"{r['bubble']:.3f} ({r['bubble_formula']:.3f})" if "bubble" in r else ""
            ovh = f"{r['overhead_per_action_s'] * 1e6:.0f} us" if "overhead_per_action_s" in r else ""
            mem = f"{r['peak_activation_bytes'] / 2 ** 20:.2f} MB" if "peak_activation_bytes" in r \
                else ""
            first = {0: str(run_["world"]), 1: f"load {run_['load_average'][0]:.1f}-"
                                                  f"{run_['load_average'][1]:.1f}"}
            t.add_row(first.get(i, ""),
                      f"{run_['model']} (w={run_['width']}, batch {run_['batch']})" if i == 0 else "",
                      r["provider"], f"{r['median_s'] * 1e3:.1f}",
                      f"{r['q10_s'] * 1e3:.0f}-{r['q90_s'] * 1e3:.0f}",
                      f"{r['loop_step_s'] * 1e3:.1f}" if "loop_step_s" in r else "",
                      f"{r['vs_whole_1t']:.2f}x",
                      f"{r['vs_micro_1t']:.2f}x", bub, ovh, mem, end_section=i == len(run_["rows"]) - 1)
    return t


def save(result: dict, out: str, note: str = "") -> None:
    """OUT.json and OUT.txt (the table, `note` under it), atomically (perf.save_result)."""
    perf.save_result({**result, "note": note}, out, table, width=260)


def main(argv=None) -> int:
    """`pyfast bench pipeline [--world 2,4] [--model large,tiny] [--repeats N] [--out P]`."""
    import argparse

    p = argparse.ArgumentParser(prog="pyfast bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--world", default="2,4")
    p.add_argument("--model", default="large,tiny")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--loop", type=int, default=10, help="steps in a row per loop round (0: none)")
    p.add_argument("--no-pin", action="store_true", help="do not pin one rank per core")
    p.add_argument("--trace", default="", help="path prefix for one traced 1f1b step")
    p.add_argument("--note", default="")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    try:
        worlds = tuple(int(w) for w in a.world.split(","))
    except ValueError:
        p.error(f"--world takes comma-separated integers, got {a.world!r}")
    if min(worlds) < 2 or a.repeats < 1 or a.loop < 0:
        p.error("--world must be >= 2, --repeats >= 1 and --loop >= 0")
    res = run(worlds, tuple(a.model.split(",")), a.repeats, not a.no_pin, a.trace or None,
              loop=a.loop)
    return perf.finish({**res, "note": a.note}, table, a.out, width=260)
