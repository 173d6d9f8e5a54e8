"""Write docs/benchmarks.md from bench/results/ (`pyfast bench report`; runs no benchmark).

The page is pyfast/benchmarks/benchmarks.md.in (the setup, targets met or missed and why, per
benchmark) with its placeholders filled from the recorded results: {{machines}} lists each
result's machine and date, {{recorded:NAME}} inserts bench/results/NAME.txt (the table the
benchmark printed) under a link to NAME.json, {{table:NAME}} a markdown table computed from the
JSON (TABLES). bench/test_report.py checks that the page in the
repository is what this writes from the results in the repository.
"""
from __future__ import annotations

import json
import os
import re
import sys
from decimal import ROUND_HALF_UP, Decimal

TEMPLATE = os.path.join(os.path.dirname(__file__), "benchmarks.md.in")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
OUT = os.path.join(ROOT, "docs", "benchmarks.md")
PLACEHOLDER = re.compile(r"\{\{(machines|recorded:([\w.-]+)|table:([\w.-]+))\}\}")


def _load(results: str, name: str) -> dict:
    path = os.path.join(results, name + ".json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _recorded(results: str, name: str) -> str:
    txt = os.path.join(results, name + ".txt")
    if not os.path.exists(txt):
        raise FileNotFoundError(f"the page quotes {txt}, which does not exist")
    with open(txt) as f:
        body = "\n".join(line.rstrip() for line in f.read().rstrip("\n").splitlines())
    link = f"[{name}.txt](../bench/results/{name}.txt)"
    if os.path.exists(os.path.join(results, name + ".json")):
        link += f", data: [{name}.json](../bench/results/{name}.json)"
    return (f"<details><summary>Recorded table: {link}</summary>\n\n```\n{body}\n```\n\n"
            f"</details>\n")


def _allreduce_1gbit(results: str) -> str:
    """allreduce.json's 1 Gbit/s rows: time, floor, and the ratios to fp32 and fp16."""
    from pyfast import perf
    rows = ["| W | spec | algorithm | ms | floor ms | % of floor | vs fp32 all-reduce | vs fp16 |",
            "|---|---|---|---|---|---|---|---|"]
    for r in _load(results, "allreduce")["rows"]:
        if r.get("link") == "1gbit" and "skipped" not in r:
            rows.append(f"| {r['world']} | {r['spec']} | {r['algorithm']} | "
                        f"{perf.stat(r, 'median_s') * 1e3:.0f} | {r['floor_s'] * 1e3:.0f} | "
                        f"{100 * r['floor_fraction']:.0f}% | {r['vs_none']:.2f}x | {r['vs_fp16']:.2f}x |")
    return "\n".join(rows)


LINK_NAMES = {"loopback": "loopback", "10gbit": "10 Gbit/s", "1gbit": "1 Gbit/s"}
TP_BLOCKS = [("loopback", "big"), ("loopback", "small"), ("10gbit", "big"), ("1gbit", "big"),
             ("1gbit", "small")]  # 10 Gbit/s small: in tp.txt
TP_COLUMNS = {"1 process x 1 thread": "1 proc x 1 thr", "1 process x 2 threads": "1 proc x 2 thr",
              "DTensor TP": "DTensor TP", "DTensor TP+SP": "DTensor TP+SP", "pyfast TP": "pyfast TP",
              "pyfast TP+SP": "pyfast TP+SP", "pyfast TP+SP+overlap": "pyfast TP+SP+overlap"}


def _tp_blocks(results: str) -> str:
    """tp.json's step ms per block and variant; bold: pyfast's variant where it is the fastest
    of the 2-rank ones."""
    rows = ["| link / block | " + " | ".join(TP_COLUMNS.values()) + " |",
            "|" + "---|" * (len(TP_COLUMNS) + 1)]
    blocks = {(b["link"], b["shape"]): {r["variant"]: r.get("median_s") for r in b["rows"]}
              for b in _load(results, "tp")["blocks"]}
    for link, shape in TP_BLOCKS:
        t = blocks[(link, shape)]
        two = {v: x for v, x in t.items() if not v.startswith("1 process") and x is not None}
        best = min(two, key=two.get)
        cells = []
        for v in TP_COLUMNS:
            ms = t[v] * 1e3
            # as read off tp.txt: one decimal, then whole ms (half up) from 100 ms
            cell = f"{ms:.1f}" if ms < 100 else str(Decimal(f"{ms:.1f}").quantize(0, ROUND_HALF_UP))
            cells.append(f"**{cell}**" if v == best and v.startswith("pyfast") else cell)
        rows.append(f"| {LINK_NAMES[link]} {shape} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _pipeline_2_ranks(results: str) -> str:
    """pipeline.json's 2-rank large-model run: each schedule's step and its speed-up over one
    process stepping the same 8 micro-batches on one thread."""
    run = next(r for r in _load(results, "pipeline")["runs"] if r["world"] == 2 and r["model"] == "large")
    by = {r["provider"]: r for r in run["rows"]}
    one = by["1 process, 8 micro-batches, 1 thread"]["median_s"]

    def line(label, names, speedup=True):
        ms = " / ".join(f"{by[n]['median_s'] * 1e3:.1f}" for n in names)
        x = " / ".join(f"{by[n]['vs_micro_1t']:.2f}x" for n in names) + " " if speedup else ""
        return f"| {label} | {ms} | {x}|"
    return "\n".join([
        f"| provider | step ms | vs 1 process, 1 thread, 8 micro-batches ({one * 1e3:.1f} ms) |",
        "|---|---|---|",
        line("pyfast gpipe / 1f1b / interleaved-1f1b / zb-h1",
             ["pyfast gpipe", "pyfast 1f1b", "pyfast interleaved-1f1b", "pyfast zb-h1"]),
        line("torch ScheduleGPipe / 1F1B / Interleaved1F1B / InterleavedZeroBubble",
             ["torch ScheduleGPipe", "torch Schedule1F1B", "torch ScheduleInterleaved1F1B",
              "torch ScheduleInterleavedZeroBubble"]),
        line("1 process, 2 threads, 8 micro-batches / whole batch",
             ["1 process, 8 micro-batches, 2 threads", "1 process, whole batch, 2 threads"], False)])


def _dp_semantics(results: str) -> str:
    """dp_semantics.json and dp_semantics_b.json (two runs) side by side: run 1 / run 2."""
    a, b = (_load(results, n)["rows"] for n in ("dp_semantics", "dp_semantics_b"))
    rows = ["| compressor | bare ms | semantics | default (`skip`) | parts timed alone / bare step |",
            "|---|---|---|---|---|"]
    for spec in a:
        def pair(fmt, key, scale=100):
            return " / ".join(fmt % (scale * r[spec][key]) for r in (a, b))
        rows.append(f"| {spec} (native engine) | {pair('%.1f', 'bare', 1e3)} | "
                    f"{pair('%+.1f%%', 'semantics_cost')} | {pair('%+.1f%%', 'default_cost')} | "
                    f"{pair('%.2f%%', 'parts_cost')} |")
    return "\n".join(rows)


def _compress_cpp(results: str) -> str:
    """compress.json's C++ rows: round trip into a new tensor vs compress + decode into a buffer
    (`accumulate_s`), each against the copy roof measured in the same run."""
    res = _load(results, "compress")
    rows = [f"Copy roof (y.copy_(x), read+write) {res['copy_GBps']:.1f} GB/s; "
            f"`torch.topk(|x|, 1%)` {res['torch_topk_s'] * 1e3:.0f} ms.", "",
            "| spec | wire x | rel err | C++ compress + decompress (new tensor) | % of copy | "
            "compress + decode into buffer | % of copy | vs torch reference |",
            "|---|---|---|---|---|---|---|---|"]
    cpp = {r["spec"]: r for r in res["rows"] if r.get("backend") == "cpp"}
    for spec in ("int8", "int4", "fp8", "sign", "topk:0.01"):
        r = cpp[spec]
        into = (f"{(r['compress_s'] + r['accumulate_s']) * 1e3:.1f} ms | "
                f"{100 * r['buffer_roof_fraction']:.0f}%" if "accumulate_s" in r else "- | -")
        vs = f"{r['speedup_vs_torch']:.1f}x" + (f" ({r['speedup_vs_torch_topk']:.0f}x torch.topk)"
                                                if "speedup_vs_torch_topk" in r else "")
        rows.append(f"| {spec} | {r['wire_ratio']:.1f} | {r['rel_error']:.4f} | "
                    f"{(r['compress_s'] + r['decompress_s']) * 1e3:.1f} ms | "
                    f"{100 * r['roof_fraction']:.0f}% | {into} | {vs} |")
    return "\n".join(rows)


TRAIN_ROWS = [  # (link, pyfast config, its torch peer, label)
    ("loopback", "pyfast dp2", "torch DDP", "pyfast dp2 / torch DDP"),
    ("loopback", "pyfast tp2", "torch DTensor TP", "pyfast tp2 / DTensor TP"),
    ("loopback", "pyfast pp2", "torch pipelining", "pyfast pp2 (1f1b, 4 mb) / pipelining"),
    ("1gbit", "pyfast dp2", "torch DDP", "pyfast dp2 / torch DDP"),
    ("1gbit", "pyfast dp2+int8", "torch DDP+bf16 hook", "pyfast dp2+int8 / DDP+bf16 hook"),
    ("1gbit", "pyfast tp2", "torch DTensor TP", "pyfast tp2 / DTensor TP"),
    ("1gbit", "pyfast pp2", "torch pipelining", "pyfast pp2 / pipelining")]


def _train(results: str) -> str:
    """train.json (global batch 8): pyfast's step beside its torch peer's; bold where faster.
    A pipeline's exposed communication is mostly its bubble."""
    from pyfast import perf
    by = {(r["link"], r["config"]): r for r in _load(results, "train")["rows"] if "config" in r}
    ms = lambda r: f"{perf.stat(r, 'median_s') * 1e3:.0f}"  # noqa: E731
    rows = ["| link | config (global batch 8) | step ms | vs torch peer | exposed comm ms | MB sent/step |",
            "|---|---|---|---|---|---|",
            f"| loopback | 1 process x 1 / x 2 threads | {ms(by[('loopback', '1proc x 1thr')])} / "
            f"{ms(by[('loopback', '1proc x 2thr')])} | | | |"]
    for link, mine, peer, label in TRAIN_ROWS:
        r, p = by[(link, mine)], by[(link, peer)]
        vs = f"{r['vs_peer']:.2f}x"
        comm = f"{r['exposed_comm_ms']:.0f}" + (" (bubble)" if "pp" in mine else "")
        rows.append(f"| {LINK_NAMES[link]} | {label} | {ms(r)} / {ms(p)} | "
                    f"{f'**{vs}**' if r['vs_peer'] > 1 else vs} | {comm} | "
                    f"{r['bytes_sent'] / 1e6:.1f} |")
    return "\n".join(rows)


DP_TARGETS = {("1gbit", "pyfast:int8"), ("1gbit", "pyfast:topk:0.01"), ("loopback", "pyfast:auto")}
DP_OMIT = {("loopback", "pyfast:int8@python")}  # in dp.txt


def _dp_label(r: dict) -> str:
    cfg = r["config"]
    if cfg.endswith("@python"):
        return cfg[:-len("@python")] + " (python engine)"
    if cfg.startswith("pyfast:topk"):
        return f"{cfg} + EF ({r['engine']})"
    if "auto_choice" in r:
        c = r["auto_choice"]
        return f"{cfg} (" + (f"picked {c[0]} x{len(c)}" if len(set(c)) == 1 else ", ".join(c)) + ")"
    return cfg + (f" ({r['engine']})" if "engine" in r else "")


def _dp(results: str) -> str:
    """dp.json: every config's step beside DDP+fp16's; bold: the rows the targets are about."""
    from pyfast import perf
    rows = ["| link | config | step ms | vs DDP+fp16 | compute ms | comm ms | "
            "step / max(comp, comm) | step / bound |", "|---|---|---|---|---|---|---|---|"]
    for r in _load(results, "dp")["rows"]:
        key = (r["link"], r["config"])
        if key in DP_OMIT or "skipped" in r:
            continue
        vs = f"{r['vs_ddp_fp16']:.2f}x"
        extra = (f" {r['compute'] * 1e3:.0f} | {r['comm'] * 1e3:.0f} | {r['overlap_ratio']:.2f} | "
                 f"{r['bound_ratio']:.2f} |" if "compute" in r else " | | | |")
        rows.append(f"| {r['link']} | {_dp_label(r)} | {perf.stat(r, 'median_s') * 1e3:.0f} | "
                    f"{f'**{vs}**' if key in DP_TARGETS else vs} |{extra}")
    return "\n".join(rows)


ZERO_RUNS = ("zero", "zero_b")
ZERO_TARGETS = {("loopback", "pyfast zero2"), ("loopback", "pyfast zero3"),
                ("1gbit", "pyfast zero3 int8+int8p")}


def _zero(results: str) -> str:
    """zero.json and zero_b.json (two runs) side by side, run 1 / run 2: each provider's step
    and its ratio to FSDP2 per link, then its memory per rank; bold: the ratios the targets are
    about (uncompressed stages 2 and 3 on loopback, stage 3 int8+int8 at 1 Gbit/s)."""
    runs = [r for r in (_load(results, n) for n in ZERO_RUNS) if r]

    def each(rows, fmt, key, scale=1.0):
        return " / ".join(fmt % (r[key] * scale) for r in rows if r.get(key) is not None)

    steps: dict = {}
    mems: dict = {}
    for run in runs:
        for r in run["rows"]:
            if "skipped" not in r:
                steps.setdefault((r["link"], r["config"]), []).append(r)
        for r in run["memory"]:
            mems.setdefault(r["config"], []).append(r)
    out = ["| link | config | step ms | vs FSDP2 | MB on the link a step | link floor ms |",
           "|---|---|---|---|---|---|"]
    for (link, cfg), rows in steps.items():
        vs = each(rows, "%.2fx", "vs_fsdp2")
        out.append(f"| {LINK_NAMES.get(link, link)} | {cfg} | {each(rows, '%.0f', 'median_s', 1e3)}"
                   f" | {f'**{vs}**' if (link, cfg) in ZERO_TARGETS else vs} | "
                   f"{each(rows, '%.0f', 'link_bytes', 1e-6)} | "
                   f"{each(rows, '%.0f', 'floor_s', 1e3)} |")
    out += ["", "| config | state MB | fp32 ZeRO model MB | state / model | RSS between steps MB "
                "| peak in a step MB | peak vs FSDP2 |", "|---|---|---|---|---|---|---|"]
    for cfg, rows in mems.items():
        out.append(f"| {cfg} | {each(rows, '%.0f', 'state', 1e-6)} | "
                   f"{rows[0]['model_bytes'] / 1e6:.0f} | {each(rows, '%.2f', 'state_vs_model')} | "
                   f"{each(rows, '%.0f', 'rss', 1e-6)} | {each(rows, '%.0f', 'peak', 1e-6)} | "
                   f"{each(rows, '%.2fx', 'peak_vs_fsdp2')} |")
    return "\n".join(out)


CP_RUNS = ("cp", "cp_b")


def _cp(results: str) -> str:
    """cp.json and cp_b.json (two runs) side by side, run 1 / run 2: per length, link and
    provider the fwd+bwd time, its speed-ups over one process, zigzag's over contiguous, the
    peak memory per rank against one process's and the ring's hidden communication; bold: the
    cells the targets are about (the longest length); then the targets, run by run."""
    runs = [r for r in (_load(results, n) for n in CP_RUNS) if r]
    if not runs:
        return "*Not recorded yet (`pyfast bench cp --out bench/results/cp`, then `cp_b`).*"

    def each(rows, fmt, key, scale=1.0, bold=False):
        cell = " / ".join(fmt % (r[key] * scale) for r in rows if r.get(key) is not None)
        return f"**{cell}**" if bold and cell else cell

    cells: dict = {}
    for run in runs:
        order = ["-", *run["links"]]
        for r in sorted((r for r in run["rows"] if "median_s" in r),
                        key=lambda r: (r["seq"], order.index(r["link"]))):
            cells.setdefault((r["seq"], r["link"], r["provider"]), []).append(r)
    longest = max(runs[0]["lengths"])
    out = ["| tokens | link | provider | fwd+bwd s | vs 1 process x 1 thread | vs 2 threads | "
           "zigzag vs contiguous | peak MB per rank | peak vs 1 process | ring comm hidden |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for (seq, link, p), rows in cells.items():
        zz = seq == longest and p == "ring zigzag"
        out.append(
            f"| {seq} | {LINK_NAMES.get(link, link)} | {p} | {each(rows, '%.3f', 'median_s')} | "
            f"{each(rows, '%.2fx', 'vs_1_thread', bold=zz and link == 'loopback')} | "
            f"{each(rows, '%.2fx', 'vs_2_threads')} | "
            f"{each(rows, '%.2fx', 'zigzag_speedup', bold=zz)} | "
            f"{each(rows, '%.0f', 'peak_bytes', 1e-6)} | "
            f"{each(rows, '%.2f', 'peak_vs_one', bold=seq == longest and link != '-')} | "
            f"{each(rows, '%.0f%%', 'hidden', 100, bold=zz and link != 'loopback')} |")
    targets: dict = {}
    for run in runs:
        for t in run["targets"]:
            targets.setdefault((t["target"], t["goal"]), []).append(
                f"{t['measured']} " + ("met" if t["met"] else f"**missed by {t['missed_by']}**"))
    out += ["", "Targets, computed from the data (run 1 / run 2):", ""]
    out += [f"- {what}, target {goal}: {' / '.join(v)}" for (what, goal), v in targets.items()]
    return "\n".join(out)


def _ablate(results: str) -> str:
    """The headline table of each recorded ablation run (bench/results/ablate, ablate_b)."""
    from pyfast.ablate.report import headline
    out = []
    for name in ("ablate", "ablate_b"):
        if os.path.exists(os.path.join(results, name, "results.csv")):
            out += [f"Run `{name}` (full report: [{name}/report.md](../bench/results/{name}/"
                    f"report.md)):", "", headline(os.path.join(results, name)), ""]
    return "\n".join(out).rstrip("\n")


TABLES = {"ablate": _ablate, "dp": _dp, "zero": _zero, "cp": _cp, "train": _train, "compress_cpp": _compress_cpp, "allreduce_1gbit": _allreduce_1gbit, "tp_blocks": _tp_blocks,
          "pipeline_2_ranks": _pipeline_2_ranks, "dp_semantics": _dp_semantics}  # {{table:NAME}}: a table computed from the JSON


def _machines(results: str, names: list[str]) -> str:
    rows = ["| result | machine | date |", "|---|---|---|"]
    for n in names:
        r = _load(results, n)
        date = str(r.get("date", "")).split(".")[0]
        rows.append(f"| {n} | {r.get('machine', 'not recorded')} | {date or 'not recorded'} |")
    return "\n".join(rows)


def render(results: str = RESULTS, template: str = TEMPLATE) -> str:
    with open(template) as f:
        text = f.read()
    names = [m.group(2) for m in PLACEHOLDER.finditer(text) if m.group(2)]

    def fill(m):
        if m.group(1) == "machines":
            return _machines(results, names)
        if m.group(3):
            return TABLES[m.group(3)](results)
        return _recorded(results, m.group(2))
    return PLACEHOLDER.sub(fill, text).rstrip("\n") + "\n"


def main(argv=None) -> int:
    import argparse

    from pyfast._io import atomic_write_text
    p = argparse.ArgumentParser(prog="pyfast bench report", description=__doc__.split("\n")[0])
    p.add_argument("--results", default=RESULTS, help="the recorded results (bench/results)")
    p.add_argument("--out", default=OUT, help="the page to write (docs/benchmarks.md)")
    a = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    atomic_write_text(a.out, render(a.results))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
