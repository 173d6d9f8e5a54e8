"""The planner (`pyfast bench plan`): how fast `pyfast plan` searches, and what it chooses for
the model sizes the folklore has rules for.

--part search: the wall time of pyfast.plan.search.search (enumerate, predict memory, predict
time for what fits, rank) on cases of 10,000+ configurations; median of --repeats, in this one
process (no torch work, pure arithmetic: the 2-core VM's other load moves it).
--part folklore: `pyfast plan`'s choice for 1B, 7B, 13B, 70B and 405B models (the reference GPT
presets gpt-1b..gpt-405b, or --family llama) on 8, 64 and 512 H100s (8 a node) at 400 and 10
Gbit/s between nodes, --seq 4096 --global-batch 1024, bf16; next to the rules of thumb "under
15B data parallel, 15-70B tensor + data on 4-8 GPUs, 70B+ full 3D" and, where the plan differs,
why (the rule's own best plan and what it loses, or why none of its kind fits).
--part memory / time: pyfast.benchmarks.plan_memory / plan_time (the models against the dry run
and measured runs). --out PREFIX writes PREFIX_search, PREFIX_folklore (.json, .txt) and passes
--out PREFIX_memory / PREFIX_time on; --docs docs/plan.md rewrites its "## The folklore,
checked" section from the folklore result.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re
import statistics

import pyfast
from pyfast import perf
from pyfast.plan import cli, shapes
from pyfast.plan.cluster import build
from pyfast.plan.search import GiB, search
from pyfast.plan.spec import Workload

# (model, GPUs, seq, global batch): each scores 10,000+ configurations (counted in the result)
SEARCH_CASES = (("gpt-7b", 512, 4096, 2048), ("gpt-1b", 512, 4096, 1024),
                ("gpt-13b", 512, 2048, 2048))
SIZES = ("1b", "7b", "13b", "70b", "405b")
GPU_COUNTS = (8, 64, 512)
LINKS = ("400gbit", "10gbit")
SEQ, BATCH = 4096, 1024
CLOSE = 1.05  # the rule's own best within 5% of the plan's time: "within 5%", not a "no"


def run_search(repeats: int) -> dict:
    rows = []
    for model, gpus, seq, batch in SEARCH_CASES:
        shape, work = shapes.preset(model), Workload(seq, batch, "bf16")
        cl = build(gpus, 8, "h100")
        times, res = [], None
        for _ in range(repeats):
            res = search(shape, work, cl)
            times.append(res.seconds)
        rows.append({"model": model, "gpus": gpus, "seq": seq, "global_batch": batch,
                     "configurations": res.memory_scored, "timed": res.time_scored,
                     "pruned": res.pruned, "meshes_refused": len(res.mesh_problems),
                     "median_s": statistics.median(times), "times_s": times})
    return {"machine": perf.machine(), "date": _now(), "pyfast": pyfast.__version__,
            "load_average": os.getloadavg()[0], "repeats": repeats, "rows": rows}


def search_table(result: dict):
    t = perf.rich_table("pyfast plan: search speed (enumerate, predict memory, time what "
                        f"fits, rank; median of {result['repeats']}, load "
                        f"{result['load_average']:.1f})", result,
                        ("model", "GPUs", "seq x batch", "configurations", "timed", "pruned",
                         "seconds", "configs/s", "s per 10,000 (target < 5)"), left=("model",))
    for r in result["rows"]:
        t.add_row(r["model"], str(r["gpus"]), f"{r['seq']} x {r['global_batch']}",
                  f"{r['configurations']:,}", f"{r['timed']:,}", f"{r['pruned']:,}",
                  f"{r['median_s']:.2f}", f"{r['configurations'] / r['median_s']:,.0f}",
                  f"{1e4 * r['median_s'] / r['configurations']:.2f}")
    return t


def rule(size: str) -> tuple[str, set]:
    """The rule of thumb for a nominal size, and the kinds of plan that agree with it."""
    b = float(size[:-1])
    if b < 15:
        return "under 15B: data parallel", {"dp"}
    if b < 70:
        return "15-70B: tensor + data, tp 4-8", {"tp+dp"}
    return "15-70B: tensor + data / 70B+: full 3D", {"tp+dp", "3d"}


def kind(p) -> str:
    if p.tp == p.pp == p.cp == 1:
        return "dp"
    if p.pp == 1 and p.cp == 1 and 4 <= p.tp <= 8:
        return "tp+dp"
    if p.tp > 1 and p.pp > 1 and p.dp > 1:
        return "3d"
    return "other"


def plan_text(s) -> str:
    p = s.plan
    out = f"dp{p.dp}" + (f" cp{p.cp}" if p.cp > 1 else "") + (f" tp{p.tp}" if p.tp > 1 else "") \
        + (f" pp{p.pp} {p.schedule}" if p.pp > 1 else "")
    out += (f" zero{p.zero}" if p.zero else "") + \
        (f" {p.compress}" if p.compress != "none" else "") + \
        f" {p.micro_batches}x{p.micro_batch}" + (" recompute" if p.activation_checkpointing else "")
    return out


def disagreement(size, shape, res, fits, kinds, cap) -> str:
    """Why the plan differs from the rule: the rule's best plan and what it loses, or why no
    plan of the rule's kind fits."""
    state = 16 * shape.params()  # fp32 weights, gradients, Adam's two moments
    theirs = [s for s in fits if kind(s.plan) in kinds]
    if theirs:
        t = theirs[0]
        loss = cli.lost(t, fits[0])
        return (f"the rule's best, {plan_text(t)}, takes {t.to_target_s / fits[0].to_target_s:.2f}"
                "x as long" + (f" ({loss})" if loss else ""))
    oom = [s for s in res.rejected if kind(s.plan) in kinds]
    if "dp" in kinds and state > cap:
        why = (f"{size.upper()} with AdamW needs {state / GiB:.0f} GiB of model state (16 bytes "
               f"a parameter): one {cap / GiB:.1f} GiB GPU cannot hold it without sharding")
        zero = [s for s in oom if s.plan.zero]
        if zero:
            s = min(zero, key=lambda s: s.peak)
            why += f"; sharded, the smallest ({plan_text(s)}) needs {s.peak / GiB:.0f} GiB"
        return why
    if oom:
        s = min(oom, key=lambda s: s.peak)
        return f"no {'/'.join(sorted(kinds))} plan fits: {plan_text(s)}: {s.reason}"
    return f"no {'/'.join(sorted(kinds))} plan can run on this mesh size"


def run_folklore(family: str) -> dict:
    rows = []
    for size in SIZES:
        shape = shapes.preset(f"{family}-{size}")
        for gpus in GPU_COUNTS:
            for link in LINKS:
                cl = build(gpus, 8, "h100", inter_bw=link)
                work = Workload(SEQ, BATCH, "bf16")
                res = search(shape, work, cl, top=10**7, rejected=10**7, distinct=False)
                text, kinds = rule(size)
                row = {"model": shape.name, "size": size, "params": shape.params(),
                       "gpus": gpus, "link": link, "rule": text, "configurations":
                       res.memory_scored, "fitting": res.fitting}
                if not res.plans:
                    row.update(plan=None, agrees="no", why=cli.nothing_fits(res, shape, work, cl))
                else:
                    best = res.plans[0]
                    theirs = [s for s in res.plans if kind(s.plan) in kinds]
                    agrees = "yes" if kind(best.plan) in kinds else "no"
                    if agrees == "no" and theirs and \
                            theirs[0].to_target_s <= CLOSE * best.to_target_s:
                        agrees = f"within {CLOSE - 1:.0%}"
                    row.update(plan=plan_text(best), fields=best.plan.fields(),
                               memory_bytes=best.peak, step_s=best.time["step_s"],
                               to_target_s=best.to_target_s, agrees=agrees,
                               why=cli.why(best, best)[len("best: "):],
                               differs=None if agrees == "yes" else disagreement(
                                   size, shape, res, res.plans, kinds, cl.gpu.memory_bytes))
                rows.append(row)
    return {"machine": perf.machine(), "date": _now(), "pyfast": pyfast.__version__,
            "family": family, "seq": SEQ, "global_batch": BATCH, "rows": rows}


def folklore_table(result: dict):
    t = perf.rich_table(f"pyfast plan's choice vs the folklore ({result['family']} presets, "
                        f"H100 x 8 a node, --seq {result['seq']} --global-batch "
                        f"{result['global_batch']} bf16)", result,
                        ("model", "GPUs", "between nodes", "plan", "GiB", "step s", "rule",
                         "agrees", "why"), left=("model", "plan", "rule", "why"))
    for r in result["rows"]:
        t.add_row(r["size"].upper(), str(r["gpus"]), r["link"], r["plan"] or "nothing fits",
                  f"{r['memory_bytes'] / GiB:.0f}" if r["plan"] else "-",
                  f"{r['step_s']:.3g}" if r["plan"] else "-", r["rule"],
                  r["agrees"], r.get("differs") or r["why"])
    return t


def markdown(result: dict) -> str:
    lines = [f"`pyfast bench plan --part folklore` ({result['family']} presets, H100 x 8 a node, "
             f"--seq {result['seq']} --global-batch {result['global_batch']} bf16; "
             f"{result['date']}, pyfast {result['pyfast']}):", "",
             "| model | GPUs | between nodes | plan | GiB/rank | step s | rule of thumb | agrees "
             "| why |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = [r["size"].upper(), str(r["gpus"]), r["link"], r["plan"] or "nothing fits",
                 f"{r['memory_bytes'] / GiB:.0f}" if r["plan"] else "-",
                 f"{r['step_s']:.3g}" if r["plan"] else "-", r["rule"],
                 "**no**" if r["agrees"] == "no" else r["agrees"], r.get("differs") or r["why"]]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_docs(path: str, result: dict) -> None:
    """Replace the body of the "## The folklore, checked" section of `path` (up to the next
    "## " heading) with the table; ValueError if there is no such section."""
    text = open(path).read()
    head = "## The folklore, checked\n"
    if head not in text:
        raise ValueError(f"{path}: no '{head.strip()}' section to rewrite")
    start = text.index(head) + len(head)
    m = re.search(r"^## ", text[start:], re.M)
    end = start + m.start() if m else len(text)
    body = text[start:end]
    keep = body.split("<!-- table -->")[0] if "<!-- table -->" in body else "\n"
    from pyfast._io import atomic_write_text
    atomic_write_text(path, text[:start] + keep + "<!-- table -->\n" + markdown(result) + "\n"
                      + text[end:])


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="all", choices=("search", "folklore", "memory", "time",
                                                     "all"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--family", default="gpt", choices=("gpt", "llama"),
                   help="folklore: the reference GPT presets (what pyfast trains) or Llama's")
    p.add_argument("--docs", default="", help="rewrite this file's folklore section")
    p.add_argument("--out", default="", help="PREFIX: write PREFIX_search, PREFIX_folklore "
                   "(.json, .txt); PREFIX_memory, PREFIX_time by their modules")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    parts = ("search", "folklore", "memory", "time") if a.part == "all" else (a.part,)
    out = lambda name: f"{a.out}_{name}" if a.out else ""  # noqa: E731
    rc = 0
    if "search" in parts:
        rc |= perf.finish(run_search(a.repeats), search_table, out("search"), width=160)
    if "folklore" in parts:
        res = run_folklore(a.family)
        rc |= perf.finish(res, folklore_table, out("folklore"), width=240)
        if a.docs:
            write_docs(a.docs, res)
            print(f"rewrote the folklore section of {a.docs}")
    for name in ("memory", "time"):
        if name in parts:  # written beside this module (issue 22's validation)
            mod = importlib.import_module(f"pyfast.benchmarks.plan_{name}")
            rc |= mod.main(["--out", out(name)] if a.out else [])
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
