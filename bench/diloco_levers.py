"""What each of issue 32's DiLoCo levers gives, in tokens (no timing): the learning-rate schedule
(constant vs cosine), the parameters validated (the replicas' own vs the outer ones), the
replicas (2 vs 4) and H, each a `pyfast train` run of Streaming DiLoCo int4 (F = 4, tau = 2)
beside data parallelism on the same global batch, seed and data as `pyfast bench diloco`.

The runs are deterministic (the same losses on any link and load: the outer all-reduce's result
is applied at a fixed step), so they run niced beside other work and need no namespace; what a
step costs on a slow link is `pyfast bench diloco`'s job. Per variant: the validation loss at
step N (equal tokens) against dp's (the same schedule's dp: cosine over N, or constant), and the
first validation at or below dp's final loss (steps; LONGER x N at most), on the replicas' own
and on the outer parameters.

    python bench/diloco_levers.py --model gpt-tiny --work /tmp/levers --out bench/results/X
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys

import pyfast
from pyfast import perf
from pyfast.benchmarks.diloco import LONGER, SIZES

S = ["--fragments", "4", "--diloco-delay", "2", "--outer-compress", "int4", "--eval-outer"]
COS, CON = ["--warmup", "20", "--min-lr-ratio", "0.1"], ["--warmup", "20", "--min-lr-ratio", "1"]
# name: (ranks, schedule, decay over K x N (cosine), flags)
VARIANTS = {
    "dp bf16, constant": (2, "constant", 1, ["--dp", "2", "--compress", "bf16"]),
    "dp bf16, cosine": (2, "cosine", 1, ["--dp", "2", "--compress", "bf16"]),
    "H40 R2, constant": (2, "constant", 1, ["--replicas", "2", "--diloco", "40", *S]),
    "H40 R2, cosine N": (2, "cosine", 1, ["--replicas", "2", "--diloco", "40", *S]),
    "H40 R2, cosine 2N": (2, "cosine", 2, ["--replicas", "2", "--diloco", "40", *S]),
    "H40 R2, cosine 2.5N": (2, "cosine", 2.5, ["--replicas", "2", "--diloco", "40", *S]),
    "H40 R4, cosine N": (4, "cosine", 1, ["--replicas", "4", "--diloco", "40", *S]),
    "H40 R4, cosine 2.5N": (4, "cosine", 2.5, ["--replicas", "4", "--diloco", "40", *S]),
    "H20 R2, cosine N": (2, "cosine", 1, ["--replicas", "2", "--diloco", "20", *S]),
    "H20 R2, cosine 2.5N": (2, "cosine", 2.5, ["--replicas", "2", "--diloco", "20", *S]),
    "H80 R2, cosine 2.5N": (2, "cosine", 2.5, ["--replicas", "2", "--diloco", "80", *S]),
}
# issue 32's second session (diloco_i32c): the levers left, each one change from "H20 R2, cosine
# N" (outer SGD lr 0.7, momentum 0.9, Nesterov: the paper's; int4; F 4, tau 2; inner lr 1e-3)
H20 = ["--replicas", "2", "--diloco", "20", *S]
_LEVERS = {
    "H20 fp32 outer": ["--outer-compress", "none"],
    "H20 outer lr 0.4": ["--outer-lr", "0.4"],
    "H20 outer lr 1.0": ["--outer-lr", "1.0"],
    "H20 outer mom 0.5": ["--outer-momentum", "0.5"],
    "H20 no Nesterov": ["--no-outer-nesterov"],
    "H20 averaging": ["--outer-lr", "1.0", "--outer-momentum", "0", "--no-outer-nesterov"],
    "H20 inner lr 2e-3": ["--lr", "2e-3"],
    "H20 inner lr 5e-4": ["--lr", "5e-4"],
    "H20 warm-up 40": ["--warmup", "40"],
    "H12 F4 tau2": ["--diloco", "12"],
    "H8 F4 tau1": ["--diloco", "8", "--diloco-delay", "1"],
    "H4 F4 tau0": ["--diloco", "4", "--diloco-delay", "0"],
}
VARIANTS.update({k + ", cosine N": (2, "cosine", 1, H20 + v) for k, v in _LEVERS.items()})
# the best of them (outer momentum 0.5) with the schedule of the time target (cosine over 2.5 N)
VARIANTS["H20 outer mom 0.5, cosine 2.5N"] = (2, "cosine", 2.5, H20 + ["--outer-momentum", "0.5"])
# one replica's own run: half the batch on one rank, no averaging (what DiLoCo starts from)
VARIANTS["one replica alone (batch / 2), cosine N"] = (1, "cosine", 1, ["--batch", "4",
                                                                  "--eval-batches", "4"])
# data parallelism at the inner-lr levers' rates: whether a rate helps DiLoCo only
VARIANTS.update({f"dp bf16 lr {lr}, cosine N": (2, "cosine", 1, ["--dp", "2", "--compress", "bf16",
                                                                  "--lr", lr])
                 for lr in ("2e-3", "5e-4")})


def _dir(work: str, name: str) -> str:
    return os.path.join(work, "".join(c if c.isalnum() else "_" for c in name))


def curve(work: str, model: str, name: str, longer: int = LONGER) -> list[tuple]:
    """(step, val_loss, val_loss_outer or None) of variant `name`, run first unless its
    metrics are in `work` already."""
    ranks, sched, k, flags = VARIANTS[name]
    seq, batch, n, every = SIZES[model]
    out = _dir(work, name)
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        steps = n if name.startswith("dp") else longer * n
        lr = (COS + ["--lr-decay-steps", str(round(k * n))]) if sched == "cosine" else CON
        cmd = [sys.executable, "-m", "pyfast", "train", "--nproc", str(ranks), "--model", model,
               "--seq", str(seq), "--batch", str(batch), "--steps", str(steps), "--eval-every",
               str(every), "--eval-batches", "2", "--seed", "0", "--no-tensorboard", "--out",
               out, *lr, *flags]
        subprocess.run(["nice", "-n", "19", *cmd], check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [(r["step"], r["val_loss"], r.get("val_loss_outer")) for r in recs if "val_loss" in r]


def levers(work: str, model: str, names, longer: int = LONGER, earlier: str = "") -> dict:
    """earlier: a result of this script whose variants' curves are taken, not run again (the
    runs are deterministic: dp bf16's 200 steps reran to the same 2.3506 on 2026-11-28)."""
    n = SIZES[model][2]
    done = {}
    if earlier:
        with open(earlier) as f:
            done = {r["variant"]: [tuple(x) for x in r["curve"]] for r in json.load(f)["rows"]}
    curves = {name: done[name] if name in done else curve(work, model, name, longer)
              for name in names}
    rows, not_run = [], [name for name, c in curves.items() if not c]
    for name, c in curves.items():
        if not c:  # stopped before its first validation (the machine's time ran out)
            continue
        ref = curves["dp bf16, " + VARIANTS[name][1]]
        target, at_n = ref[-1][1], {s: (v, o) for s, v, o in c}.get(n, (math.nan, None))
        row = {"variant": name, "target": target, "curve": c, "steps_run": c[-1][0]}
        # a run cut short: its last validation against dp's at the same step
        dp_at = {s: v for s, v, _ in ref}
        last = max((s for s, _, _ in c if s in dp_at), default=None)
        row["last"] = None if last is None else {
            "step": last, "vs_dp": dict((s, v) for s, v, _ in c)[last] / dp_at[last] - 1}
        for which, i in (("own", 1), ("outer", 2)):
            hit = next((s for s, *v in c if v[i - 1] is not None and v[i - 1] <= target), None)
            v = at_n[i - 1]
            row[which] = {"val_at_n": v, "vs_dp": v / target - 1 if v is not None else None,
                          "steps_to_dp_final": hit}
        rows.append(row)
    return {"machine": perf.machine(), "date": datetime.datetime.now().isoformat("T", "seconds"),
            "pyfast": pyfast.__version__, "model": model, "sizes": SIZES[model], "rows": rows,
            "not_run": not_run}


def table(result: dict):
    seq, batch, n, _ = result["sizes"]
    t = perf.rich_table(f"DiLoCo's levers in tokens ({result['model']}, seq {seq}, batch {batch}, "
                        f"N = {n}; Streaming int4, F 4, tau 2; each against dp bf16 with the same "
                        f"schedule; steps to dp's final loss: first validation at or below it, "
                        f"- : not within {LONGER} N)", result,
                        ("variant", "dp final", "own: val @ N", "vs dp", "steps to dp final",
                         "outer: val @ N", "vs dp", "steps to dp final", "last val step",
                         "own vs dp there"), left=("variant",))
    for r in result["rows"]:
        cells = []
        for which in ("own", "outer"):
            w = r[which]
            cells += ["-", "-", "-"] if w["val_at_n"] is None or math.isnan(w["val_at_n"]) else [
                f"{w['val_at_n']:.4f}", f"{w['vs_dp']:+.2%}",
                str(w["steps_to_dp_final"] or f"- ({r['steps_run']} run)")]
        last = r.get("last")
        cells += ["-", "-"] if last is None else [str(last["step"]), f"{last['vs_dp']:+.2%}"]
        t.add_row(r["variant"], f"{r['target']:.4f}", *cells)
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny", choices=tuple(SIZES))
    p.add_argument("--variants", default="", help="semicolon-separated (default: all)")
    p.add_argument("--work", required=True, help="a folder for the runs (kept: a rerun reads them)")
    p.add_argument("--out", default="")
    p.add_argument("--earlier", default="", metavar="JSON",
                   help="a result of this script: its variants' curves are reused, not rerun")
    p.add_argument("--longer", type=int, default=LONGER,
                   help=f"DiLoCo runs take up to this many x N steps (default {LONGER}; 1: only "
                        "the equal-token comparison, a third of the time)")
    a = p.parse_args(argv)
    names = [v.strip() for v in a.variants.split(";") if v.strip()] or list(VARIANTS)
    names = sorted(set(names) | {"dp bf16, " + VARIANTS[v][1] for v in names}, key=list(VARIANTS).index)
    return perf.finish(levers(a.work, a.model, names, a.longer, a.earlier), table, a.out, width=170)


if __name__ == "__main__":
    raise SystemExit(main())
