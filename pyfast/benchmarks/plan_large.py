"""pyfast bench plan_large: the planner's large-model plans (issue 33): gpt-70b on 64 H100 and
gpt-405b on 512 H100 (8 a node, 400 Gbit/s between nodes), bf16.

For each case: the whole search's size (configurations scored, fitting, seconds), the top plans
(mesh, ZeRO stage and shard group, predicted tokens/s, MFU, memory a rank, the `pyfast train`
command), and the best plan of each kind: without ZeRO, ZeRO over the whole dp x cp group,
ZeRO sharded within a node (--zero-shard-group). MFU = tokens/s x the model's FLOPs a token
(spec.ModelShape.flops_per_token: 6 N + attention) / (GPUs x the datasheet's bf16 peak).
Predictions only (arithmetic, no training): run against two checkouts (--label before /
after) to compare the planner's answers; the seconds are the search's on this shared machine.

Cases: 70B as issue 33 states it (--seq 4096 --global-batch 512); 405B at Llama 3's opening
batch (Dubey et al. 2024, section 3.4.1: 4M tokens in sequences of 4,096: --global-batch 1024).
"""
from __future__ import annotations

import argparse
import datetime
import os

import pyfast
from pyfast import perf
from pyfast.plan import cli, shapes
from pyfast.plan.cluster import build
from pyfast.plan.search import GiB, search
from pyfast.plan.spec import Workload

CASES = (("gpt-70b", 64, 4096, 512), ("gpt-405b", 512, 4096, 1024))
TOP = 10


def kind(p) -> str:
    """no ZeRO / ZeRO S / ZeRO S in a node (hybrid), and whether dp > 1 (the issue's ask)."""
    k = "no ZeRO" if not p.zero else \
        f"ZeRO {p.zero} in a node" if getattr(p, "shard_group", 0) else f"ZeRO {p.zero}"
    return k + (", dp > 1" if p.dp > 1 else "")


def _row(s, shape, work, cl) -> dict:
    t = s.time
    mfu = t["tokens_per_s"] * shape.flops_per_token(work.seq) / (cl.gpus * cl.gpu.flops_16)
    text = cli.describe(s) + (f", {s.plan.cp_method}" if s.plan.cp > 1 else "")
    return {"plan": text, "fields": s.plan.fields(), "kind": kind(s.plan),
            "memory_gib": s.peak / GiB, "where": s.memory["where"], "step_s": t["step_s"],
            "tokens_per_s": t["tokens_per_s"], "mfu": mfu, "to_target_s": s.to_target_s,
            "why": cli.why(s, s)[len("best: "):], "command": cli.command(s, shape, work, cl)}


def run(label: str) -> dict:
    cases = []
    for model, gpus, seq, batch in CASES:
        shape, work = shapes.preset(model), Workload(seq, batch, "bf16")
        cl = build(gpus, 8, "h100")
        res = search(shape, work, cl, top=TOP)
        full = search(shape, work, cl, top=10**7, rejected=0, distinct=False)
        best = {}
        for s in full.plans:  # ranked best first: the first of each kind
            best.setdefault(kind(s.plan), s)
        cases.append({"model": model, "params": shape.params(), "gpus": gpus, "seq": seq,
                      "global_batch": batch, "configurations": res.memory_scored,
                      "timed": res.time_scored, "fitting": res.fitting,
                      "search_s": res.seconds,
                      "top": [_row(s, shape, work, cl) for s in res.plans],
                      "best_of_kind": {k: _row(s, shape, work, cl) for k, s in best.items()}})
    return {"machine": perf.machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "pyfast": pyfast.__version__, "label": label, "load_average": os.getloadavg()[0],
            "cases": cases}


def table(res: dict):
    from rich.console import Group
    parts = []
    for c in res["cases"]:
        t = perf.rich_table(
            f"pyfast plan ({res['label']}): {c['model']} on {c['gpus']} H100 (8 a node, 400 "
            f"Gbit/s), --seq {c['seq']} --global-batch {c['global_batch']} bf16; "
            f"{c['configurations']:,} scored, {c['fitting']:,} fit, {c['search_s']:.1f} s",
            res, ("#", "plan", "kind", "GiB/rank", "step s", "tokens/s", "MFU", "why"),
            left=("plan", "kind", "why"))
        for i, r in enumerate(c["top"], 1):
            t.add_row(str(i), r["plan"], r["kind"], f"{r['memory_gib']:.1f}",
                      f"{r['step_s']:.3g}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}",
                      r["why"])
        for k, r in c["best_of_kind"].items():
            t.add_row("best", r["plan"], k, f"{r['memory_gib']:.1f}", f"{r['step_s']:.3g}",
                      f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}", r["why"])
        parts.append(t)
        if c["top"] and c["top"][0]["command"]:
            parts.append(f"#1's command: {c['top'][0]['command']}")
    return Group(*parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench plan_large",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="", help="what this checkout is (e.g. before, after)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    return perf.finish(run(a.label), table, a.out, width=200)


if __name__ == "__main__":
    raise SystemExit(main())
