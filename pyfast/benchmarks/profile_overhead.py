"""What pyfast's named ranges (pyfast._ranges) cost a training step when no profiler runs:

    pyfast bench profile_overhead --out bench/results/profile_overhead

- end to end: `pyfast train` gpt-small dp2 (seq 256, batch 8, 2 ranks x 1 thread, gloo on
  loopback) launched in pairs, with the ranges (as shipped) and without them (PYFAST_RANGES=0,
  read at import: every `ranged` function is then the undecorated function and `span` a bare
  no-op), the order swapped from pair to pair so the machine's drift hits both alike; each
  launch's median step_ms over its steps after the first two, the ratio per pair, and its
  median over the pairs;
- per range: the no-op cost of a `with span(...)` block and of a `ranged` call, in this
  process (median of 7 loops of 200,000);
- ranges per step: one more launch with --profile counts the pyfast.* ranges every thread of
  rank 0 opened in a step; count x cost is the ranges' expected share of the step.

`--hetero 0.5 --out bench/results/profile_hetero`: instead, the --profile split of a mixed
pair (rank 1 capped at half a core): what the fast rank's exposed communication looks like.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from pyfast import perf

MODEL = "gpt-small"
FLAGS = ["--dp", "2", "--nproc", "2", "--batch", "8", "--seq", "256",
         "--tensorboard", "off", "--no-plot", "--eval-batches", "1"]


def _launch(out: str, steps: int, ranges: bool, extra=(), model: str = MODEL) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYFAST_RANGES", None)
    if not ranges:
        env["PYFAST_RANGES"] = "0"
    cmd = [sys.executable, "-m", "pyfast", "train", "--model", model, *FLAGS, "--steps",
           str(steps), "--out", out, *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step_ms"] for line in f]


def noop_ns(n: int = 200_000) -> dict:
    """ns a `with span(...)` block and a `ranged` call add with no profiler (medians of 7)."""
    from pyfast._ranges import ranged, span

    def f(x):
        return x
    g = ranged("pyfast.comm.bench")(f)

    def loop(body):
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            body()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) / n * 1e9

    def empty():
        for _ in range(n):
            pass

    def spans():
        for _ in range(n):
            with span("pyfast.comm.all_reduce"):
                pass

    def plain():
        for _ in range(n):
            f(1)

    def wrapped():
        for _ in range(n):
            g(1)
    base, call = loop(empty), loop(plain)
    return {"span_ns": loop(spans) - base, "ranged_ns": loop(wrapped) - call}


def ranges_per_step(root: str, steps: int, model: str = MODEL) -> dict:
    """pyfast.* ranges (every thread of rank 0, the step ranges left out) per profiled step."""
    import glob
    out = os.path.join(root, "counted")
    _launch(out, steps, True, ["--profile", f"3:{steps + 1}"], model)
    (path,) = glob.glob(os.path.join(out, "profile", "rank0.*.pt.trace.json"))
    with open(path) as f:
        evs = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    n = sum(1 for e in evs if e["name"].startswith("pyfast.")
            and not e["name"].startswith("pyfast.train.step#"))
    return {"ranges": n / (steps - 2), "steps": steps - 2}


def _throttled_rank(rank: int, port: int, argv: list, share: float) -> None:
    """One rank of `pyfast train ARGV` (pyfast.train.run.main: it exits the process), rank 1
    capped at `share` CPUs (pyfast.hetero.throttle, held until the process exits)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    from pyfast.hetero import throttle
    from pyfast.train.config import from_args, parser
    from pyfast.train.run import main
    held = throttle(share) if rank == 1 else None
    if held is not None:
        held.__enter__()  # kept referenced: a collected generator context would lift the cap
    main(from_args(parser().parse_args(argv)))


def hetero(share: float = 0.5, steps: int = 5) -> dict:
    """The split of a mixed pair: gpt-small dp2, seq 128, rank 1 at `share` CPUs, steps 3..END
    profiled; each rank's mean split (seconds)."""
    import multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        argv = ["--model", MODEL, "--dp", "2", "--batch", "8", "--seq", "128", "--steps",
                str(steps), "--profile", f"3:{steps + 1}", "--out", out, "--tensorboard", "off",
                "--eval-batches", "1"]
        ctx = mp.get_context("spawn")
        ps = [ctx.Process(target=_throttled_rank, args=(r, port, argv, share)) for r in (0, 1)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(600)
        if any(p.exitcode != 0 for p in ps):
            raise RuntimeError(f"the throttled pair failed: exit codes {[p.exitcode for p in ps]}")
        with open(os.path.join(out, "profile", "split.json")) as f:
            split = json.load(f)
    return {"share": share, "steps": split["window"],
            "ranks": [{"rank": r["rank"], **r["mean"]} for r in split["ranks"]]}


def run(pairs: int = 3, steps: int = 6, model: str = MODEL) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {}
            for on in order:
                ms = _launch(os.path.join(root, f"{i}-{on}"), steps, on, (), model)[2:]
                got[on] = statistics.median(ms)
            rows.append({"pair": i, "first": "ranges" if order[0] else "none",
                         "ranges_ms": got[True], "none_ms": got[False],
                         "ratio": got[True] / got[False]})
        count = ranges_per_step(root, steps, model)
    cost = noop_ns()
    step_ms = statistics.median(r["none_ms"] for r in rows)
    per_step_us = count["ranges"] * max(cost["span_ns"], cost["ranged_ns"]) / 1e3
    return {"machine": perf.machine(), "date": datetime.date.today().isoformat(),
            "config": f"{model} dp2, seq 256, batch 8, 2 ranks x 1 thread, gloo loopback; "
                      f"{steps} steps a launch, the first 2 dropped",
            "pairs": rows, "ratio_median": statistics.median(r["ratio"] for r in rows),
            "ratio_range": [min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)],
            **cost, **count, "expected_us_per_step": per_step_us,
            "expected_pct": 100 * per_step_us / 1e3 / step_ms}


def table(result: dict):
    t = perf.rich_table("named ranges with no profiler: step time with / without (PYFAST_RANGES=0)",
                        result, ("pair", "first", "ranges ms", "none ms", "ratio"), left=("first",))
    for r in result["pairs"]:
        t.add_row(str(r["pair"]), r["first"], f"{r['ranges_ms']:.1f}", f"{r['none_ms']:.1f}",
                  f"{r['ratio']:.3f}")
    lo, hi = result["ratio_range"]
    t.caption = (f"{result['config']}. Median ratio {result['ratio_median']:.3f} (pairs "
                 f"{lo:.3f}-{hi:.3f}). No-op cost: span {result['span_ns']:.0f} ns, ranged "
                 f"{result['ranged_ns']:.0f} ns; {result['ranges']:.0f} ranges a step (rank 0, "
                 f"every thread) -> {result['expected_us_per_step']:.1f} us a step, "
                 f"{result['expected_pct']:.4f}% of the step")
    return t


def hetero_table(result: dict):
    from pyfast.train.profile_split import PARTS
    t = perf.rich_table(f"--profile split of gpt-small dp2, rank 1 capped at {result['share']} "
                        f"CPUs, steps {result['steps'][0]}..{result['steps'][1] - 1} (mean ms, %)",
                        result, ("rank", "step ms", *PARTS))
    for r in result["ranks"]:
        t.add_row(str(r["rank"]), f"{1e3 * r['step_s']:.0f}",
                  *(f"{1e3 * r[p + '_s']:.0f} ({r[p + '_pct']:.0f}%)" for p in PARTS))
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench profile_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model", default=MODEL, help="the job's --model (a smoke test: gpt-tiny)")
    p.add_argument("--out", default="")
    p.add_argument("--hetero", type=float, default=0.0, metavar="SHARE",
                   help="instead: the --profile split of a gpt-small dp2 pair whose rank 1 is "
                        "capped at SHARE CPUs (pyfast.hetero.throttle; root)")
    a = p.parse_args(argv)
    if a.hetero:
        return perf.finish({"machine": perf.machine(), "date": datetime.date.today().isoformat(),
                            **hetero(a.hetero)}, hetero_table, a.out)
    if a.steps < 3:
        p.error(f"--steps must be >= 3 (the first 2 are dropped), got {a.steps}")
    return perf.finish(run(a.pairs, a.steps, a.model), table, a.out)
