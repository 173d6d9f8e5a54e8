"""DIR/report.md and the PNGs beside it, from DIR/results.csv and DIR/cells/*.jsonl.

Everything is relative to the bf16 baseline of the same link and world size (spec "bf16";
the median over seeds where there are several): time to the target loss, final loss, and for
the cost model predicted / measured step time. A target not reached reads "not reached", never
a number. The best fixed choice is the non-auto cell that reached the target soonest.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict

from .schema import BASELINE, read_rows

NOISE = 0.05  # one seed: differences under 5% are noise (identical cells differed by up to 8%)


def _f(r: dict, k: str) -> float:
    v = r.get(k, "")
    return float(v) if v not in ("", None) else math.nan


def _config(r: dict) -> str:
    ef = r["error_feedback"]
    b = "" if float(r["bucket_mb"] or 0) == 0 else f" @{float(r['bucket_mb']):g}MB"
    return r["spec"] + ("" if ef == "n/a" else f" EF {ef}") + b


def _tt(rows: list[dict]) -> float:
    """Median time to target over the seeds; inf if any seed did not reach it."""
    ts = [_f(r, "time_to_target_s") if r["reached"] == "yes" else math.inf for r in rows]
    return statistics.median(ts) if ts else math.nan


def _groups(rows):
    """{(link, world): {config: [rows over seeds]}} of finished cells, in the CSV's order."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[(r["link"], int(r["world"]))][_config(r)].append(r)
    return out


def summarize(rows: list[dict]) -> dict:
    """Per (link, world): baseline time, best fixed config, auto's config/choice/time."""
    out = {}
    for key, configs in _groups(rows).items():
        done = {c: rs for c, rs in configs.items() if all(r["status"] == "done" for r in rs)}
        base = [rs for c, rs in done.items() if rs[0]["spec"] == BASELINE]
        t_base = _tt(base[0]) if base else math.nan
        fixed = {c: _tt(rs) for c, rs in done.items() if rs[0]["spec"] != "auto"}
        best = min(fixed, key=fixed.get) if fixed else None
        autos = {c: _tt(rs) for c, rs in done.items() if rs[0]["spec"] == "auto"}
        # auto as DataParallel runs it by default (error feedback on), whatever the other did
        auto = next((c for c in autos if done[c][0]["error_feedback"] == "on"),
                    next(iter(autos), None))
        errs = [abs(_f(r, "predicted_step_ms") / _f(r, "step_ms") - 1)
                for rs in done.values() for r in rs if _f(r, "step_ms") > 0]
        out[key] = {"t_base": t_base, "best": best, "t_best": fixed.get(best, math.nan),
                    "auto": auto, "t_auto": autos.get(auto, math.nan),
                    "auto_choice": done[auto][0]["auto_choice"] if auto else "",
                    "pred_err": max(errs) if errs else math.nan,
                    "pred_ok": sum(e <= 0.15 for e in errs), "cells": len(errs)}
    return out


def _time(t: float) -> str:
    return "not reached" if math.isinf(t) else "-" if math.isnan(t) else f"{t:.2f}"


def _ratio(a: float, b: float) -> str:
    if math.isinf(a):
        return "not reached"
    return "-" if math.isnan(a) or math.isnan(b) or math.isinf(b) else f"{b / a:.2f}x"


def headline(out: str) -> str:
    """One row per link and world: bf16's time to target, the best fixed choice and its
    speedup, auto's pick and its time against the best and against bf16, the cost model's
    worst error. Speedups are bf16 time / config time (> 1: sooner than bf16)."""
    lines = ["| link | W | bf16 to target (s) | best fixed | its speedup vs bf16 | auto picked | "
             "auto vs best (time) | auto speedup vs bf16 | cost model: cells within 15%, "
             "worst |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (link, world), s in summarize(read_rows(out)).items():
        vs_best = "-" if s["auto"] is None else (
            "not reached" if math.isinf(s["t_auto"]) else f"{s['t_auto'] / s['t_best']:.3f}")
        lines.append(f"| {link} | {world} | {_time(s['t_base'])} | {s['best'] or '-'} | "
                     f"{_ratio(s['t_best'], s['t_base'])} | {s['auto'] or '-'}: "
                     f"{s['auto_choice'] or '-'} | {vs_best} | "
                     f"{_ratio(s['t_auto'], s['t_base'])} | {s['pred_ok']} of {s['cells']}, "
                     f"{100 * s['pred_err']:.0f}% |")
    return "\n".join(lines)


COLS = ("config", "steps to target", "time to target (s)", "speedup vs bf16", "final loss",
        "vs bf16", "val loss", "step ms", "compute", "encode", "comm", "decode", "exposed",
        "wire KB/step", "lo KB/step", "predicted ms", "pred/meas", "peak RSS MB", "auto picked")


def _table(configs: dict, s: dict) -> list[str]:
    base = next((rs for rs in configs.values() if rs[0]["spec"] == BASELINE), None)
    base_loss = statistics.median(_f(r, "final_loss") for r in base) if base else math.nan
    order = sorted(configs, key=lambda c: (configs[c][0]["status"] != "done", _tt(configs[c])))
    lines = ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    for c in order:
        rs = configs[c]
        r = rs[0]
        if r["status"] != "done":
            lines.append(f"| {c} | {r['status']}: {r['reason'] or '-'} |" + " |" * (len(COLS) - 2))
            continue
        med = lambda k: statistics.median(_f(x, k) for x in rs)  # noqa: E731
        t = _tt(rs)
        steps = [x["steps_to_target"] for x in rs]
        mark = " **best**" if c == s["best"] else ""
        ms = lambda k: f"{med(k):.1f}"  # noqa: E731
        kb = lambda k: "-" if math.isnan(med(k)) else f"{med(k) / 1e3:.0f}"  # noqa: E731
        lines.append(
            f"| {c}{mark} | {'not reached' if math.isinf(t) else '/'.join(steps)} | {_time(t)} | "
            f"{_ratio(t, s['t_base'])} | {med('final_loss'):.4f} | "
            f"{med('final_loss') - base_loss:+.4f} | {med('val_loss'):.4f} | {ms('step_ms')} | "
            f"{ms('compute_ms')} | {ms('encode_ms')} | {ms('comm_ms')} | {ms('decode_ms')} | "
            f"{ms('exposed_comm_ms')} | {kb('wire_bytes_per_step')} | {kb('lo_bytes_per_step')} | "
            f"{ms('predicted_step_ms')} | {med('predicted_step_ms') / med('step_ms'):.2f} | "
            f"{med('peak_rss_mb'):.0f} | {r['auto_choice'] or ''} |")
    return lines


def _targets(summary: dict) -> list[str]:
    out = []
    for (link, world), s in summary.items():
        speed = s["t_base"] / s["t_best"] if s["t_best"] > 0 else math.nan
        if link == "loopback":
            ok = speed <= 1 + NOISE or s["best"] is not None and s["best"].startswith(BASELINE)
            out.append(f"- {link}, W={world}: best fixed {s['best']} {speed:.2f}x bf16's time: "
                       f"{'met' if ok else 'missed'} (none should beat bf16 by more than "
                       f"{100 * NOISE:.0f}%)")
        else:
            ok = speed > 1 + NOISE
            out.append(f"- {link}, W={world}: best fixed {s['best']} reaches the target "
                       f"{speed:.2f}x sooner than bf16: {'met' if ok else 'missed'} (some "
                       f"compressor sooner than bf16 by more than {100 * NOISE:.0f}%)")
        if s["auto"] is not None:
            vs_best, vs_base = s["t_auto"] / s["t_best"], s["t_auto"] / s["t_base"]
            ok = vs_best <= 1.05 and vs_base <= 1 + NOISE
            out.append(f"- {link}, W={world}: auto ({s['auto_choice']}) {vs_best:.3f}x the best "
                       f"fixed time, {vs_base:.3f}x bf16's: {'met' if ok else 'missed'} (within "
                       f"5% of the best, never later than bf16 beyond the noise)")
        out.append(f"- {link}, W={world}: cost model within 15% of the measured step for "
                   f"{s['pred_ok']} of {s['cells']} cells, worst off by "
                   f"{100 * s['pred_err']:.0f}%: {'met' if s['pred_err'] <= 0.15 else 'missed'} "
                   "(within 15% for every cell)")
    return out


def write(out: str) -> str:
    rows = read_rows(out)
    path = os.path.join(out, "report.md")
    if not rows:
        return path
    r0 = rows[0]
    stamps = sorted(r["timestamp"] for r in rows if r["timestamp"])
    counts = defaultdict(int)
    for r in rows:
        counts[r["status"]] += 1
    summary = summarize(rows)
    md = [f"# Compression ablation: {r0['task']}, {r0['steps']} steps, target loss "
          f"{r0['target_loss']}", "",
          f"{next((r['machine'] for r in rows if r['machine']), '?')}; "
          f"torch {r0['torch']}, pyfast {r0['pyfast']}; "
          f"{stamps[0] if stamps else '?'} .. {stamps[-1] if stamps else '?'}. "
          f"Cells: {', '.join(f'{n} {k}' for k, n in counts.items())}.", "",
          "Time to target: training seconds until the mean loss of the last 10 steps is at or "
          "below the target; speedup = bf16's time / the config's (> 1: sooner). "
          "Times per step in ms (medians after 3 warm-up steps); compute/encode/decode from "
          "the cell's probes, comm = the reductions' own time, exposed = what the step waited.",
          "", "## Headline", "", headline(out), "", "## Targets", "", *_targets(summary), ""]
    skipped = {r["reason"] for r in rows if r["status"] == "skipped"}
    if skipped:
        md += ["Skipped: " + "; ".join(sorted(skipped)), ""]
    for (link, world), configs in _groups(rows).items():
        md += [f"## {link}, {world} ranks", "", *_table(configs, summary[(link, world)]), ""]
    pngs = plots(out, rows, summary)
    md += ["## Plots", ""] + [f"![{p}]({p})" for p in pngs] + [""]
    from pyfast._io import atomic_write_text
    atomic_write_text(path, "\n".join(md))
    return path


def _curve(out: str, cell: str) -> list[dict]:
    p = os.path.join(out, "cells", cell + ".jsonl")
    if not os.path.exists(p):
        return []
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def _bandwidth(link: str) -> float:
    from pyfast.netns import rate_bps
    return rate_bps(link) or math.inf


def plots(out: str, rows: list[dict], summary: dict) -> list[str]:
    """The PNGs (file names, in DIR): loss vs step / vs time per link, speedup vs bandwidth,
    auto vs best fixed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    world0 = int(rows[0]["world"])
    target = float(rows[0]["target_loss"])
    for link in dict.fromkeys(r["link"] for r in rows):
        cells = [r for r in rows if r["link"] == link and int(r["world"]) == world0
                 and r["status"] in ("done", "diverged") and r["seed"] == rows[0]["seed"]]
        if not cells:
            continue
        for x, name in (("step", "step"), ("t_s", "time")):
            fig, ax = plt.subplots(figsize=(8, 5))
            for r in cells:
                c = _curve(out, r["cell"])
                ax.plot([p[x] for p in c], [p["smooth_loss"] for p in c], label=_config(r), lw=1)
            ax.axhline(target, ls="--", color="k", lw=0.8, label="target")
            ax.set(xlabel="step" if x == "step" else "training seconds", ylabel="loss (mean of "
                   "10 steps)", title=f"{rows[0]['task']} on {link}, {world0} ranks",
                   ylim=(target * 0.9, target * 1.6))
            ax.legend(fontsize=7, ncol=2)
            made.append(_save(fig, out, f"loss_vs_{name}_{link}.png"))
    keys = sorted({k for k in summary}, key=lambda k: _bandwidth(k[0]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    configs = dict.fromkeys(_config(r) for r in rows if r["spec"] != BASELINE)
    xs = {k: i for i, k in enumerate(keys)}
    for c in configs:
        pts = []
        for k in keys:
            rs = _groups(rows)[k].get(c, [])
            t = _tt(rs) if rs and all(r["status"] == "done" for r in rs) else math.nan
            if math.isfinite(t) and summary[k]["t_base"] > 0:
                pts.append((xs[k], summary[k]["t_base"] / t))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=c, lw=1)
    ax.axhline(1, color="k", lw=0.8, label="bf16")
    ax.set_xticks(range(len(keys)), [f"{link}\nW={w}" for link, w in keys])
    ax.set(ylabel="speedup to target vs bf16", title="time to target: bf16 / config "
           "(missing: not reached)")
    ax.legend(fontsize=7, ncol=2)
    made.append(_save(fig, out, "speedup_vs_bandwidth.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.27
    for i, (label, key) in enumerate((("bf16", "t_base"), ("best fixed", "t_best"),
                                      ("auto", "t_auto"))):
        vals = [summary[k][key] if math.isfinite(summary[k][key]) else 0 for k in keys]
        ax.bar([j + (i - 1) * w for j in range(len(keys))], vals, w, label=label)
    ax.set_xticks(range(len(keys)), [f"{link}\nW={wd}" for link, wd in keys])
    ax.set(ylabel="seconds to target", title="auto vs the best fixed choice and bf16")
    ax.legend()
    made.append(_save(fig, out, "auto_vs_best.png"))
    return made


def _save(fig, out: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=90)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return name
