"""The planner for mixed clusters against measured runs on an emulated heterogeneous pair
(`pyfast bench plan_mixed`): two ranks on this machine, rank 1 capped at SHARE of a CPU
(pyfast.hetero.throttle, through the job's bench-only PYFAST_THROTTLE), rank 0 a whole one.

1. Calibrate with the planner's own probes (pyfast.plan.calibrate.measure: compute at the local
   shapes, the loopback link, DataParallel's wait, the job's own cost), then a block's forward
   and backward sustained for 3 s in two processes at once, one inside throttle(SHARE): their
   ratio makes the two "GPU types" (FLOP/s), the uncapped one over one process alone the
   compute scale (what two ranks at once cost each other here; refit's compute_scale).
2. Write a 2-group cluster TOML ([[nodes]]: one node of one rank each, [gpu] tables based on
   "cpu" with the two rates) and plan on it (nodes.with_calibration: each group priced with the
   plain calibration, its compute scaled by the measured rate over its own): the dp2 plan's
   predicted step split evenly and split by speed (the planner's --batch-split).
3. Run `pyfast train --nproc 2 --dp 2` with rank 1 throttled, even and with that split,
   interleaved REPEATS times; each run's median step after WARMUP.
Reported: predicted vs measured step (% error) for each split; the uneven split's gain
(even / uneven step), predicted vs measured.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

import pyfast
from pyfast import perf

MODEL, SEQ, BATCH, SHARE = "gpt-small", 64, 16, 0.5
STEPS, WARMUP, REPEATS = 12, 3, 2
SUSTAIN_S = 3.0  # seconds of the sustained probe, plain and throttled (30 CFS periods)
PLAN = dict(dp=2, zero=0, compress="none", micro_batches=1)  # the plan compared


def toml_text(fast: float, slow: float, share: float) -> str:
    """The emulated pair as a [[nodes]] cluster file: the compute probe's FLOP/s, plain and
    throttled, as the two groups' GPUs (fp32 = fp16: a CPU runs both at its rate)."""
    out = ["# written by `pyfast bench plan_mixed`: this machine's compute probe, plain and "
           f"throttled to {share} CPU"]
    for name, rate in (("cpu", fast), (f"cpu-{share:g}", slow)):
        out += ["[[nodes]]", f'name = "{name}"', "count = 1", "gpus_per_node = 1",
                f'gpu = {{ base = "cpu", flops_32 = {rate:.6g}, flops_16 = {rate:.6g} }}', ""]
    return "\n".join(out)


def sustained_s(shape, work, micro_batch: int, seconds: float = SUSTAIN_S) -> float:
    """Seconds of one forward + backward of the plan's block, averaged over `seconds` of them
    back to back (one thread). Not the probe's median of single calls: under a CFS quota
    (share x 100 ms a period) a call of a few ms runs at full speed until the period's quota
    is spent, so the median saw 1.06:1 at a 0.5 share where the 3 s average sees ~2:1."""
    import torch
    from pyfast.plan.calibrate_compute import _local_block
    from pyfast.plan.spec import Plan
    torch.set_num_threads(1)
    _, block = _local_block(shape, Plan(dp=2, micro_batch=micro_batch), work)
    x = torch.randn(micro_batch, work.seq, shape.hidden, requires_grad=True)
    block(x).sum().backward()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        block(x).sum().backward()
        n += 1
    return (time.perf_counter() - t0) / n


def _pair_child(shape, work, micro_batch: int, share, q) -> None:
    """One of the two processes of pair_sustained: this process at `share` CPU (None: not
    capped), then its sustained block seconds put on `q`."""
    if share is not None:
        from pyfast.hetero import throttle
        with throttle(share):
            q.put((share, sustained_s(shape, work, micro_batch)))
    else:
        q.put((share, sustained_s(shape, work, micro_batch)))


def pair_sustained(shape, work, micro_batch: int, share: float) -> tuple[float, float]:
    """(the uncapped, the capped process's sustained block seconds) with both running at once,
    as the job's two ranks do: what each gets of this machine's 2 cores beside the other (and
    beside other work) is in it, which one process alone does not see (batch 12: alone 2.16:1,
    the job's even step 1.5x its uncapped one)."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_pair_child, args=(shape, work, micro_batch, s, q))
          for s in (None, share)]
    for p in ps:
        p.start()
    got = dict(q.get(timeout=120) for _ in ps)
    for p in ps:
        p.join(timeout=30)
    return got[None], got[share]


def calibrate_pair(shape, work, share: float, sizes) -> tuple[dict, float, float]:
    """(the plain calibration, with compute at every micro-batch in `sizes` and the pair's
    compute scale; the capped rank's FLOP/s; the pair's slowdown). The probes (calibrate.
    measure) time one process at a time; the two ranks of the job run at once, one capped:
    pair_sustained times that, and its uncapped process over one process alone is the
    compute scale (refit's compute_scale: what the ranks cost each other here), its capped
    over its uncapped the slowdown of the slow type."""
    from pyfast.plan import calibrate, hardware
    from pyfast.plan.spec import Plan
    base = hardware.Cluster(2, 1, hardware.gpu("cpu"), 1.0, 1.0)
    cl = calibrate.measure(shape, work, base, "loopback",
                           [Plan(dp=2, micro_batch=BATCH // 2)])
    plans = [Plan(dp=2, micro_batch=b) for b in sizes]
    cal = dict(cl.calibration)
    more = calibrate.measure_compute(shape, work, plans)
    cal["compute"] = {**more["compute"], **cal["compute"]}
    alone = sustained_s(shape, work, BATCH // 2)
    fast, slow = pair_sustained(shape, work, BATCH // 2, share)
    cal["compute_scale"] = fast / alone
    cal["pair_sustained_s"] = {"alone": alone, "fast": fast, "slow": slow}
    return cal, cal["flops_s"] * fast / slow, slow / fast


def predict(path: str, cal: dict, shape, work) -> dict:
    """The dp2 plan of the planner's mixed search on the TOML: even and uneven."""
    from pyfast.plan import cluster
    from pyfast.plan.mixed import search_mixed
    from pyfast.plan.nodes import with_calibration
    mc = with_calibration(cluster.build(cluster_file=path), cal, work.precision,
                          work.global_batch)
    res = search_mixed(shape, work, mc, top=10 ** 6, distinct=False)
    pick = [s for s in res.plans if all(getattr(s.plan, k) == v for k, v in PLAN.items())
            and not s.plan.activation_checkpointing]
    if not pick:
        raise RuntimeError(f"the planner kept no {PLAN} plan on {mc.label()}")
    s = pick[0]
    return {"even_s": s.even["step_s"], "uneven_s": s.uneven["step_s"] if s.uneven else None,
            "split": s.uneven["split"] if s.uneven else s.even["split"],
            "per_type_even": s.even["per_type"],
            "per_type_uneven": s.uneven["per_type"] if s.uneven else None,
            "flags": s.flags(), "rank": res.plans.index(s) + 1}


def measure_run(split: list[int] | None, share: float, timeout: float = 300) -> dict:
    """`pyfast train --nproc 2 --dp 2` with rank 1 at `share` CPU: the median step after WARMUP."""
    from pyfast.train.metrics import read
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "pyfast", "train", "--nproc", "2", "--dp", "2",
               "--model", MODEL, "--seq", str(SEQ), "--batch", str(BATCH), "--steps", str(STEPS),
               "--eval-batches", "1", "--out", out, "--precision", "fp32", "--no-plot"]
        if split:
            cmd += ["--batch-split", ",".join(map(str, split))]
        env = dict(os.environ, PYFAST_THROTTLE=f"1:{share}")
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-2000:]}")
        recs = read(os.path.join(out, "metrics.jsonl"))
    if split and recs[-1].get("batch_split") not in (None, list(split)):
        raise RuntimeError(f"the run logged batch_split {recs[-1]['batch_split']}, not {split}")
    ms = sorted(x["step_ms"] for x in recs[WARMUP:])
    return {"step_s": statistics.median(ms) / 1e3, "q10_s": ms[len(ms) // 10] / 1e3,
            "q90_s": ms[-1 - len(ms) // 10] / 1e3,
            "logged_split": recs[-1].get("batch_split")}


def run(share: float = SHARE, repeats: int = REPEATS) -> dict:
    from pyfast.hetero import available
    from pyfast.plan import shapes
    from pyfast.plan.spec import Workload
    why = available()
    if why:
        raise SystemExit(f"pyfast bench plan_mixed: {why}")
    t0, load = time.monotonic(), os.getloadavg()[0]
    shape, work = shapes.resolve(MODEL, None), Workload(SEQ, BATCH, "fp32")
    cal, slow, slowdown = calibrate_pair(shape, work, share, range(1, BATCH))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "pair.toml")
        text = toml_text(cal["flops_s"], slow, share)
        with open(path, "w") as f:
            f.write(text)
        pred = predict(path, cal, shape, work)
    runs = {"even": [], "uneven": []}
    for _ in range(repeats):  # interleaved: drift on the shared box hits both alike
        runs["even"].append(measure_run(None, share))
        runs["uneven"].append(measure_run(pred["split"], share))
    meas = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    rows = []
    for k in ("even", "uneven"):
        p = pred[f"{k}_s"]
        rows.append({"split": k, "batch_split": pred["split"] if k == "uneven" else
                     [BATCH // 2] * 2, "predicted_s": p, "measured_s": meas[k],
                     "error": p / meas[k] - 1 if p else None,
                     "runs": [r["step_s"] for r in runs[k]],
                     "q10_q90": [[r["q10_s"], r["q90_s"]] for r in runs[k]]})
    return {"machine": perf.machine(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "pyfast": pyfast.__version__, "model": MODEL, "seq": SEQ, "batch": BATCH,
            "steps": STEPS, "warmup": WARMUP, "share": share, "repeats": repeats,
            "flops_fast": cal["flops_s"], "flops_slow": slow,
            "speed_ratio": slowdown, "toml": text, "prediction": pred, "calibration": cal,
            "rows": rows, "gain_predicted": pred["even_s"] / pred["uneven_s"]
            if pred["uneven_s"] else None,
            "gain_measured": meas["even"] / meas["uneven"],
            "load_before": load, "wall_s": time.monotonic() - t0}


def table(result: dict):
    from rich.console import Group
    t = perf.rich_table(
        f"{result['model']}, seq {result['seq']}, global batch {result['batch']}, fp32, dp2: "
        f"rank 1 at {result['share']:g} CPU (probe rates {result['flops_fast'] / 1e9:.1f} vs "
        f"{result['flops_slow'] / 1e9:.1f} GFLOP/s: {result['speed_ratio']:.2f}:1); step "
        f"predicted (pyfast plan on the pair's TOML) vs measured (median of "
        f"{result['repeats']} runs' median step after {result['warmup']})", result,
        ("split", "--batch-split", "predicted ms", "measured ms", "runs ms", "error"),
        left=("split", "--batch-split"))
    for r in result["rows"]:
        t.add_row(r["split"], ",".join(map(str, r["batch_split"])),
                  f"{r['predicted_s'] * 1e3:.0f}" if r["predicted_s"] else "-",
                  f"{r['measured_s'] * 1e3:.0f}",
                  ", ".join(f"{x * 1e3:.0f}" for x in r["runs"]),
                  f"{r['error']:+.1%}" if r["error"] is not None else "-")
    gp, gm = result["gain_predicted"], result["gain_measured"]
    lines = [f"gain of the uneven split (even / uneven step): predicted "
             + (f"{gp:.2f}x" if gp else "-") + f", measured {gm:.2f}x",
             f"wall {result['wall_s']:.0f} s; 1-min load average before: "
             f"{result['load_before']:.2f} (2 cores shared with other helpers' niced jobs)"]
    return Group(t, "\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench plan_mixed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=float, default=SHARE, help="rank 1's CPU share (default 0.5)")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    return perf.finish(run(a.share, a.repeats), table, a.out, width=190)


if __name__ == "__main__":
    raise SystemExit(main())
