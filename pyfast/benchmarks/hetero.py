"""Mixed-speed data parallel (`pyfast bench hetero`): two ranks at a 2:1 speed ratio, emulated on
one box by capping rank 1 at half a CPU (pyfast.hetero.throttle(0.5), entered at the rank's
start; every rank one torch thread), plain loopback. Throughput (samples/s of the global batch)
of the main job's real step (pyfast.train.job.Job, dp 2) at

  even           --batch-split even (today's split: batch / 2 each)
  auto           --batch-split auto (pyfast.train.rebalance), rebalancing every --every steps
                 from the even split; its warm-up steps (at the even split until the first
                 rebalance) are listed but not in the median
  fixed:A,B      --batch-split A,B; the best of them is the "best fixed split"
  fast alone     the fast rank alone (one process, one thread, unthrottled: a child of rank 0
                 with a 1-rank group, while rank 1 waits), on its share of the batch (A of the
                 best fixed split)

Model: gpt-small (6 layers, d 384, 10.6M parameters), seq 256: compute dominates its step
(one thread: ~285 ms of forward + backward per sample against ~150 ms of exposed gradient
all-reduce a step at dp 2, bench/results/train.txt), which is the regime in which splitting by
speed pays; with gpt-tiny the step is mostly fixed per-step costs (the all-reduce, the
optimizer, Python) that no split moves.

Step time: the slowest rank's, median over the timed steps, a barrier before each; the
configurations step in turn (round robin), so each sees the same machine. The ideal for auto is
1.5x the even split (the slow rank's share of the work drops from 1/2 to 1/3) and 1.5x the fast
rank alone (two ranks at 1 + 1/2 the speed of one).

`measure(configs, ...)` is the hook for other mixed-speed comparisons on the same throttled
pair: configs maps a name to TrainConfig fields (e.g. {"pp even": {"pp": 2}, "pp auto":
{"pp": 2, "pp_balance": "auto"}} for uneven pipeline stages); `solo` adds the fast-alone row.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing
import os
import statistics
import tempfile

import pyfast
from pyfast import netns, perf
from pyfast._io import atomic_write_text

SHARE = 0.5  # rank 1's CPUs: half a core beside rank 0's whole one (2.03:1 measured, hetero.py)
FIXED = ("7,5", "8,4", "9,3")  # around 2:1 of the default batch 12


def _job(fields: dict, j: dict):
    import torch

    from pyfast.train.config import TrainConfig
    from pyfast.train.job import Job
    fields = {"model": j["model"], "batch": j["batch"], "seq": j["seq"],
              "steps": j["warmup"] + j["steps"], **fields}
    cfg = TrainConfig(**fields)
    return Job(cfg, torch.device("cpu"))


def _solo(conn, j: dict, fields: dict) -> None:
    """The fast-alone row: a 1-rank group of its own in a child of (unthrottled) rank 0."""
    import torch
    import torch.distributed as dist
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    job = _job(fields, j)
    conn.send("ready")
    while (i := conn.recv()) is not None:
        t0 = perf.clock()
        rec = job.train_step(i)
        conn.send((perf.clock() - t0, rec))
    job.close()
    netns.finish_group()


def _recv(conn, child, timeout: float):
    """The child's answer; RuntimeError naming its exit code if it died (a rank blocked on a
    dead child would hang the launch until its timeout)."""
    waited = 0.0
    while not conn.poll(1.0):
        waited += 1.0
        if not child.is_alive() or waited > timeout:
            raise RuntimeError(f"the fast-alone child {'exited with ' + str(child.exitcode) if not child.is_alive() else 'timed out'}")
    return conn.recv()


def _worker() -> None:
    import torch
    import torch.distributed as dist

    from pyfast import hetero
    j = json.loads(os.environ["PYFAST_HETERO"])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    group = None
    if rank in j["slow"]:  # before the group and the model: everything this rank does is slow
        cap = hetero.throttle(j["share"])
        group = cap.__enter__()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=j["timeout"]))
    jobs = {name: _job(fields, j) for name, fields in j["configs"].items()}
    child = conn = None
    if j["solo"] is not None and rank == 0:
        conn, there = multiprocessing.Pipe()
        child = multiprocessing.get_context("spawn").Process(target=_solo,
                                                             args=(there, j, j["solo"]))
        child.start()
        if _recv(conn, child, j["timeout"]) != "ready":
            raise RuntimeError("the fast-alone child did not start")
    names = list(jobs) + (["fast alone"] if j["solo"] is not None else [])
    log = {n: {"times": [], "recs": []} for n in names}
    for i in range(1, j["warmup"] + j["steps"] + 1):
        for name in names:
            dist.barrier()
            t0 = perf.clock()
            if name == "fast alone":
                if conn is not None:  # rank 1 waits in the next barrier meanwhile
                    conn.send(i)
                    secs, rec = _recv(conn, child, j["timeout"])
                else:
                    secs, rec = 0.0, {}
            else:
                rec = jobs[name].train_step(i)
                secs = perf.clock() - t0
            log[name]["times"].append(secs)
            log[name]["recs"].append({k: rec[k] for k in ("batch_split", "compute_ms",
                                                          "exposed_comm_ms", "loss")
                                      if k in rec})
    if conn is not None:
        conn.send(None)
        child.join(120)
    for name, job in jobs.items():
        bal = getattr(job, "balancer", None)
        if bal is not None and bal.last is not None:
            log[name]["last_rebalance"] = bal.last
        job.close()
    jobs = None
    gc.collect()
    if group is not None:
        log["throttled_periods"] = hetero.throttled_usage(group)
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, log)
    if rank == 0:
        atomic_write_text(j["out"], json.dumps(each))
    dist.barrier()
    netns.finish_group()


def measure(configs: dict, model: str = "gpt-small", seq: int = 256, batch: int = 12,
            steps: int = 6, warmup: int = 4, share: float = SHARE, slow=(1,),
            solo: dict | None = None, timeout: float = 1800) -> tuple[list[dict], list]:
    """Each configuration (name -> TrainConfig fields) stepped in turn on 2 ranks, the ranks in
    `slow` capped at `share` CPUs; solo: the fields of a 1-rank job run by an unthrottled
    child of rank 0 ("fast alone"). One row per name: the slowest rank's step times, their
    median after `warmup` steps, samples/s, and each rank's records of the job; and per rank
    the cap's (periods throttled, periods) (hetero.throttled_usage; None: not capped)."""
    from pyfast import hetero
    why = hetero.available()
    if why:
        raise hetero.HeteroUnavailable(why)
    j = {"configs": configs, "model": model, "seq": seq, "batch": batch, "steps": steps,
         "warmup": warmup, "share": share, "slow": list(slow), "solo": solo,
         "timeout": timeout}
    with tempfile.TemporaryDirectory() as d:
        j["out"] = os.path.join(d, "r.json")
        netns.run_ranks(["-c", "from pyfast.benchmarks.hetero import _worker; _worker()"], 2,
                        "loopback", timeout, env={"PYFAST_HETERO": json.dumps(j)})
        with open(j["out"]) as f:
            each = json.load(f)
    rows = []
    for name in list(configs) + (["fast alone"] if solo is not None else []):
        per = [e[name] for e in each]
        times = [max(ts) for ts in zip(*(p["times"] for p in per))]
        n = solo["batch"] if name == "fast alone" and "batch" in solo else batch
        timed = times[warmup:]
        row = {"config": name, "times": times, **perf.summary(timed),
               "samples_s": n / statistics.median(timed), "batch": n,
               "recs": [p["recs"] for p in per]}
        splits = [r.get("batch_split") for r in per[0]["recs"]]
        if any(s is not None for s in splits):
            row["splits"] = splits
        if "last_rebalance" in per[0]:
            row["last_rebalance"] = per[0]["last_rebalance"]
        rows.append(row)
    cap = [e.get("throttled_periods") for e in each]
    return rows, cap


def speed_ratio(rows: list[dict], warmup: int) -> float | None:
    """The pair's speed ratio as it ran: at the even split (same samples on both ranks), the
    median over the timed steps of rank 1's compute ms / rank 0's. The machine's load moves it
    (rank 0 is not capped, so whatever else runs on the box takes from it)."""
    even = next((r for r in rows if r["config"] == "even"), None)
    if even is None or len(even["recs"]) < 2:
        return None
    r0, r1 = (recs[warmup:] for recs in even["recs"])
    return statistics.median(b["compute_ms"] / a["compute_ms"] for a, b in zip(r0, r1))


def targets(rows: list[dict], warmup: int = 0) -> list[dict]:
    sps = {r["config"]: r["samples_s"] for r in rows}
    fixed = [r for r in rows if r["config"].startswith("fixed:")]
    out = []
    r = speed_ratio(rows, warmup)
    if "auto" in sps and "even" in sps:
        out.append({"target": "auto >= 1.3 x even (ideal 1.5 at 2:1)",
                    "ratio": sps["auto"] / sps["even"], "need": 1.3})
        if r is not None:  # the even split runs at the slow rank's pace, the ideal at both
            out.append({"target": f"auto vs even, ideal at the measured {r:.2f}:1 = (1 + r) / 2 "
                        f"= {(1 + r) / 2:.3f}", "ratio": sps["auto"] / sps["even"],
                        "need": None})
    if fixed and "auto" in sps:
        best = max(fixed, key=lambda r: r["samples_s"])
        out.append({"target": f"auto vs the best fixed split ({best['config']})",
                    "ratio": sps["auto"] / best["samples_s"], "need": None})
    if "fast alone" in sps:
        for k in ("auto", "even"):
            if k in sps:
                out.append({"target": f"{k} vs the fast rank alone (ideal 1.5)",
                            "ratio": sps[k] / sps["fast alone"], "need": None})
    for t in out:
        t["met"] = None if t["need"] is None else t["ratio"] >= t["need"]
    return out


def run(model: str = "gpt-small", seq: int = 256, batch: int = 12, steps: int = 6,
        warmup: int = 6, every: int = 3, fixed=FIXED, share: float = SHARE) -> dict:
    configs = {"even": {"dp": 2}, "auto": {"dp": 2, "batch_split": "auto",
                                           "batch_split_every": every}}
    configs.update({f"fixed:{f}": {"dp": 2, "batch_split": f} for f in fixed})
    # the fast rank's share: the first number of the split closest to the speed ratio 1 : share
    mine = min(fixed, key=lambda f: abs(int(f.split(",")[0]) / batch - 1 / (1 + share))) \
        if fixed else None
    solo = {"batch": int(mine.split(",")[0])} if mine else None
    load = os.getloadavg()[0]
    rows, cap = measure(configs, model, seq, batch, steps, warmup, share, solo=solo)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    return {"machine": perf.machine(), "date": date, "pyfast": pyfast.__version__,
            "model": model, "seq": seq, "batch": batch, "steps": steps, "warmup": warmup,
            "every": every, "share": share, "throttled_periods": cap,
            "load_avg": [load, os.getloadavg()[0]], "rows": rows,
            "speed_ratio": speed_ratio(rows, warmup), "targets": targets(rows, warmup)}


def table(result: dict):
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    load = result["load_avg"]
    t = perf.rich_table(
        f"mixed-speed data parallel: 2 ranks, rank 1 capped at {result['share']} CPU, "
        f"{result['model']} seq {result['seq']}, global batch {result['batch']}, fp32, 1 "
        f"thread/rank, median of {result['steps']} steps after {result['warmup']} (slowest "
        f"rank); auto rebalances every {result['every']}; 1-min load avg {load[0]:.2f} before, "
        f"{load[1]:.2f} after", result,
        ("config", "step ms", "samples/s", "vs even", "split (timed steps)",
         "compute ms r0 / r1"), left=("config", "split (timed steps)"))
    even = next((r["samples_s"] for r in result["rows"] if r["config"] == "even"), None)
    w = result["warmup"]
    for r in result["rows"]:
        splits = sorted({tuple(s) for s in r.get("splits", [])[w:] if s})
        comp = [statistics.median(x.get("compute_ms", 0.0) for x in recs[w:])
                for recs in r["recs"]]
        t.add_row(escape(r["config"]), f"{r['median_s'] * 1e3:.0f}", f"{r['samples_s']:.2f}",
                  f"{r['samples_s'] / even:.2f}x" if even else "",
                  " ".join(",".join(map(str, s)) for s in splits) or f"{r['batch']}",
                  " / ".join(f"{c:.0f}" for c in comp))
    g = Table(title="targets (samples/s ratios)")
    for col in ("target", "ratio", "need", "met"):
        g.add_column(col)
    for x in result["targets"]:
        g.add_row(escape(x["target"]), f"{x['ratio']:.3f}",
                  f">= {x['need']}" if x["need"] else "",
                  "" if x["met"] is None else "met" if x["met"] else "MISSED")
    return Group(t, g)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench hetero", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=12, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=6, help="untimed steps first (auto "
                   "rebalances in them: at steps 3 and 6 by default)")
    p.add_argument("--every", type=int, default=3, help="auto's --batch-split-every (3: "
                   "windows of 2 and 3 measured steps inside the warm-up; the job's default "
                   "10 would need a 20-step warm-up here)")
    p.add_argument("--fixed", default=",".join(f.replace(",", ":") for f in FIXED),
                   help="fixed splits to try, A:B[,A:B...] (the best is the best fixed split)")
    p.add_argument("--share", type=float, default=SHARE, help="rank 1's CPU cap")
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    fixed = tuple(f.replace(":", ",") for f in a.fixed.split(",") if f)
    res = run(a.model, a.seq, a.batch, a.steps, a.warmup, a.every, fixed, a.share)
    return perf.finish(res, table, a.out, width=170)


if __name__ == "__main__":
    raise SystemExit(main())
