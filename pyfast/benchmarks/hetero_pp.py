"""Speed-weighted pipeline stages (`pyfast bench hetero_pp`): two pp ranks at a 2:1 speed
ratio, emulated on one box by capping rank 1 at half a CPU (pyfast.hetero.throttle(0.5),
entered at the rank's start, before its group and model; every rank one torch thread), plain
loopback. The main job's real step (pyfast.train.job.Job, --pp 2, 1f1b) at

  even           --pp-balance even (today's cut: equal parameters per stage)
  auto           --pp-balance auto: each rank times the 0.5 s matmul probe at start
                 (pyfast.parallel.stage_costs), throttled rank included
  declared 1,2   --pp-balance 1,2: the ideal costs, declared

Model: a 12-block GPT (d 192, 4 heads, seq 128; byte vocabulary): 14 layers (embed, 12
blocks, head), deep enough that a 2:1 cut exists (8 + 4 blocks); batch 16 in 8 micro-batches.
The ideal is 1.5x the even split (the slow rank's blocks drop from 6 to 4 at half speed: 12
-> 8 units of time). Throughput: the slowest rank's step (a barrier before each; the
configurations step in turn, round robin, so each sees the same machine), median over the
timed steps. Per-stage idle: the job's metrics ("pp_idle", each stage's seconds waiting on its
peer / its pipeline wall time), median over the timed steps.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile

import pyfast
from pyfast import netns, perf
from pyfast._io import atomic_write_text

SHARE = 0.5  # rank 1's CPUs: half a core beside rank 0's whole one (2.03:1 measured, hetero.py)
MODEL = "gpt:layers=12,heads=4,hidden=192"
CONFIGS = {"even": {}, "auto": {"pp_balance": "auto"}, "declared 1,2": {"pp_balance": "1,2"}}


def _job(fields: dict, j: dict):
    import torch

    from pyfast.train.config import TrainConfig
    from pyfast.train.job import Job
    cfg = TrainConfig(model=j["model"], batch=j["batch"], seq=j["seq"], pp=2,
                      micro_batches=j["m"], schedule="1f1b",
                      steps=j["warmup"] + j["steps"], **fields)
    return Job(cfg, torch.device("cpu"))


def _worker() -> None:
    import torch
    import torch.distributed as dist

    from pyfast import hetero
    j = json.loads(os.environ["PYFAST_HETERO_PP"])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    group = cap = None
    if rank == 1:  # before the group and the model: everything this rank does is slow
        # (cap held to the end: a context manager collected early would lift the cap)
        cap = hetero.throttle(j["share"])
        group = cap.__enter__()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=j["timeout"]))
    jobs = {name: _job(fields, j) for name, fields in j["configs"].items()}
    log = {}
    for name, job in jobs.items():
        p = job.pipe
        log[name] = {"times": [], "idle": [], "stage_costs": p.stage_costs,
                     "probe_s": p.probe_s,
                     "layers": [p.bounds[s + 1] - p.bounds[s] for s in range(p.n_stages)]}
    for i in range(1, j["warmup"] + j["steps"] + 1):
        for name, job in jobs.items():
            dist.barrier()
            t0 = perf.clock()
            rec = job.train_step(i)
            log[name]["times"].append(perf.clock() - t0)
            log[name]["idle"].append(rec.get("pp_idle"))
    if j["trace"]:  # one traced step of the even and the auto cut: the bubble, drawn
        from pyfast.parallel import save_trace
        for name in ("even", "auto"):
            job = jobs[name]
            job.opt.zero_grad(set_to_none=True)
            x, y = job.shard(*job.batches.next())
            dist.barrier()
            job.pipe.step(x, y, trace=True)  # x used on the first stage, y on the last
            save_trace(f"{j['trace']}_{name}.json",
                       title=f"--pp-balance {name}, rank 1 capped at {j['share']} CPU")
    for job in jobs.values():
        job.close()
    jobs = None
    gc.collect()
    if group is not None:
        log["throttled_periods"] = hetero.throttled_usage(group)
    del cap
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, log)
    if rank == 0:
        atomic_write_text(j["out"], json.dumps(each))
    dist.barrier()
    netns.finish_group()


def run(model: str = MODEL, seq: int = 128, batch: int = 16, m: int = 8, steps: int = 12,
        warmup: int = 2, share: float = SHARE, timeout: float = 1800,
        trace: str = "") -> dict:
    """trace: a path prefix: PREFIX_even.json/.png and PREFIX_auto.json/.png, one traced step
    of each after the timed ones (pyfast.parallel.save_trace)."""
    from pyfast import hetero
    why = hetero.available()
    if why:
        raise hetero.HeteroUnavailable(why)
    load0 = os.getloadavg()[0]
    j = {"configs": CONFIGS, "model": model, "seq": seq, "batch": batch, "m": m,
         "steps": steps, "warmup": warmup, "share": share, "timeout": timeout,
         "trace": os.path.abspath(trace) if trace else ""}
    with tempfile.TemporaryDirectory() as d:
        j["out"] = os.path.join(d, "r.json")
        netns.run_ranks(["-c", "from pyfast.benchmarks.hetero_pp import _worker; _worker()"],
                        2, "loopback", timeout, env={"PYFAST_HETERO_PP": json.dumps(j)})
        with open(j["out"]) as f:
            each = json.load(f)
    rows = []
    for name in CONFIGS:
        per = [e[name] for e in each]
        times = [max(ts) for ts in zip(*(p["times"] for p in per))]
        timed = times[warmup:]
        idle = [r for r in per[0]["idle"][warmup:] if r]
        rows.append({"config": name, "times": times, **perf.summary(timed),
                     "samples_s": batch / statistics.median(timed),
                     "layers": per[0]["layers"], "stage_costs": per[0]["stage_costs"],
                     "probe_s": per[0]["probe_s"],
                     "idle": [statistics.median(s) for s in zip(*idle)] if idle else None})
    sps = {r["config"]: r["samples_s"] for r in rows}
    for r in rows:
        r["vs_even"] = r["samples_s"] / sps["even"]
    targets = [{"target": f"{k} >= 1.2 x even (ideal 1.5)", "ratio": sps[k] / sps["even"],
                "need": 1.2, "met": sps[k] / sps["even"] >= 1.2} for k in ("auto", "declared 1,2")]
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' setting, for the machine line
    machine = perf.machine()
    torch.set_num_threads(threads)
    return {"machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "pyfast": pyfast.__version__, "torch": torch.__version__, "model": model,
            "seq": seq, "batch": batch, "micro_batches": m, "schedule": "1f1b",
            "steps": steps, "warmup": warmup, "share": share,
            "throttled_periods": [e.get("throttled_periods") for e in each],
            "load_average_start_end": [load0, os.getloadavg()[0]], "rows": rows,
            "targets": targets}


def table(result: dict):
    t = perf.rich_table(
        f"pipeline stages at a 2:1 speed ratio: {result['model']}, seq {result['seq']}, batch "
        f"{result['batch']} in {result['micro_batches']} micro-batches, 1f1b, pp 2, rank 1 "
        f"capped at {result['share']} CPU; median of {result['steps']} steps",
        result, ("config", "layers per stage", "costs", "step ms", "q10-q90", "samples/s",
                 "vs even", "idle per stage"), left=("config",))
    for r in result["rows"]:
        costs = ",".join(f"{c:.2f}" for c in r["stage_costs"]) if r["stage_costs"] else "-"
        idle = ", ".join(f"{100 * f:.0f}%" for f in r["idle"]) if r["idle"] else "-"
        t.add_row(r["config"], ",".join(map(str, r["layers"])), costs,
                  f"{1e3 * r['median_s']:.0f}", f"{1e3 * r['q10_s']:.0f}-{1e3 * r['q90_s']:.0f}",
                  f"{r['samples_s']:.2f}", f"{r['vs_even']:.2f}x", idle)
    for tg in result["targets"]:
        t.add_row(f"target: {tg['target']}", "", "", "", "", "", f"{tg['ratio']:.2f}x",
                  "met" if tg["met"] else "MISSED")
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench hetero_pp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    p.add_argument("--trace", default="", metavar="PREFIX",
                   help="also one traced step of the even and the auto cut: PREFIX_even.json/"
                        ".png, PREFIX_auto.json/.png")
    a = p.parse_args(argv)
    result = run(a.model, a.seq, a.batch, a.micro_batches, a.steps, a.warmup, trace=a.trace)
    return perf.finish(result, table, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
