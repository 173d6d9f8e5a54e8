"""On a GPU, at the roof (`pyfast bench gpu`, issue 37): the memory roof, the quantizers, top-k,
the fused linear and the attention block against cuBLAS / flash, and the engine's overlap.

One command for a lent GPU (tools/gpu_check.sh runs it after the build and the GPU tests):
each part (gpu_parts.py) runs in a child process under its own time limit (LIMITS: a hung or
slow part costs its limit, not the lease; the others still run), and the result names the GPU,
driver, torch, triton and CUDA versions. Rates: each kernel's bytes a second as a fraction of
the measured copy roof (`roof`: y.copy_(x) of 1 GiB, read + write) and of the datasheet's HBM
bandwidth (pyfast.plan.hardware, matched by device name); compute as TFLOPS beside cuBLAS
(F.linear) and flash attention (scaled_dot_product_attention). The targets are issue 37's; on
the CPU (`--small`, what the tests run) they are reported but are not a target run.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch

import pyfast
from pyfast import perf

from .gpu_parts import PARTS

# seconds a part may take on one H100 / H200 (the full sizes; 9 minutes in all with the
# build's and tests' share of a 15-minute lease left to tools/gpu_check.sh's other steps)
LIMITS = {"roof": 30, "quantize": 120, "topk": 60, "linear": 90, "attention": 90, "overlap": 60}
SMALL_LIMIT = 300  # a CPU part at --small sizes (the Triton interpreter is not used)
QUANT_TARGETS = {"int8": 0.85, "fp8": 0.85, "int4": 0.80, "sign": 0.80}  # of the copy roof


def versions(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "pyfast": pyfast.__version__}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        try:
            import pynvml
            pynvml.nvmlInit()
            out["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as e:  # noqa: BLE001  (nvidia-ml-py absent or no NVML: say so)
            out["driver"] = f"unknown ({type(e).__name__})"
    return out


def datasheet_bps(name: str) -> float | None:
    """HBM bytes/s of the GPU whose torch name is `name` (pyfast.plan.hardware's table)."""
    from pyfast.plan.hardware import GPUS
    low = name.lower()
    if "a100" in low:
        return GPUS["a100-40gb" if "40gb" in low else "a100-80gb"].hbm_bps
    return next((GPUS[k].hbm_bps for k in ("h200", "h100") if k in low), None)


def _child(part: str, device: str, small: bool, path: str) -> None:
    res = PARTS[part](torch.device(device), small)
    with open(path, "w") as f:
        json.dump(res, f)


def run_part(part: str, device: str, small: bool) -> dict:
    """The part in a child process under its limit: its dict, or {"error": ...}."""
    limit = SMALL_LIMIT if small else LIMITS[part]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "part.json")
        code = (f"from pyfast.benchmarks.gpu import _child; "
                f"_child({part!r}, {device!r}, {small!r}, {path!r})")
        try:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=limit)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {limit} s"}
        if p.returncode != 0:
            return {"error": f"exit {p.returncode}: " + (p.stderr.strip().splitlines() or [""])[-1]}
        with open(path) as f:
            return json.load(f)


def run(device: str = "cuda", parts=tuple(PARTS), small: bool = False, log=print) -> dict:
    dev = torch.device(device)
    res = {"machine": perf.machine(), "device": device, "small": small,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "versions": versions(dev), "parts": {}}
    for part in parts:
        log(f"{part} ...")
        res["parts"][part] = run_part(part, device, small)
    res["datasheet_GBps"] = (datasheet_bps(res["versions"]["gpu"]) or 0) / 1e9 \
        if "gpu" in res["versions"] else None
    annotate(res)
    res["targets"] = targets(res)
    return res


def annotate(res: dict) -> None:
    """Each rate as a fraction of the measured roof and of the datasheet's."""
    roof = res["parts"].get("roof", {}).get("GBps")
    sheet = res.get("datasheet_GBps")
    q = res["parts"].get("quantize", {})
    for r in q.get("rows", []):
        for key in ("compress_", "decompress_", ""):
            r[f"{key}roof"] = r[f"{key}GBps"] / roof if roof else None
            r[f"{key}sheet"] = r[f"{key}GBps"] / sheet if sheet else None
    t = res["parts"].get("topk", {})
    for r in t.get("rows", []):  # one read of the input at the roof's read rate (half its bytes)
        r["reads"] = r["seconds"] * roof * 1e9 / 2 / (4 * t["numel"]) if roof else None


def targets(res: dict) -> list[dict]:
    out, p = [], res["parts"]
    gpu = not res["small"] and res["device"].startswith("cuda")

    def add(what, value, goal, ok):
        out.append({"target": what, "measured": value, "goal": goal,
                    "met": (bool(ok) if gpu else None)})
    for r in p.get("quantize", {}).get("rows", []):
        goal = QUANT_TARGETS.get(r["kind"])
        if goal and r["backend"] in ("cpp", "triton") and r.get("roof") is not None:
            add(f"{r['kind']} ({r['backend']}) compress + decompress, of the copy roof",
                f"{100 * r['roof']:.0f}%", f">= {100 * goal:.0f}%", r["roof"] >= goal)
    for r in p.get("topk", {}).get("rows", []):
        if r["impl"].startswith("pyfast") and r.get("reads") is not None:
            goal = 2.0 if r["exact"] else 1.3
            add(f"{r['impl']}: {'exact' if r['exact'] else 'threshold mode'}, reads of the "
                "input", f"{r['reads']:.2f}", f"<= {goal:g}", r["reads"] <= goal)
    for r in p.get("linear", {}).get("rows", []):
        add(f"linear_act {r['M']}x{r['K']}x{r['N']} vs cuBLAS GEMM only", f"{r['vs_gemm']:.2f}x",
            ">= 0.9x", r["vs_gemm"] >= 0.9)
        if r["N"] >= 4 * r["K"]:  # output-heavy: the separate epilogue's bytes weigh
            add(f"linear_act {r['M']}x{r['K']}x{r['N']} vs GEMM + separate GELU",
                f"{r['vs_separate']:.2f}x", ">= 1.1x", r["vs_separate"] >= 1.1)
    for r in p.get("attention", {}).get("rows", []):
        if r["D"] == 128 and r["S"] >= 4096:
            add(f"block attention fwd S={r['S']} D=128", f"{r['pyfast_TFLOPS']:.0f} TFLOPS",
                ">= 450 TFLOPS", r["pyfast_TFLOPS"] >= 450)
    o = p.get("overlap", {})
    if "compute_slowdown" in o:
        add("matmuls slowed by the engine's all-reduces beside them",
            f"{100 * o['compute_slowdown']:+.0f}%", "<= 10%", o["compute_slowdown"] <= 0.10)
    for name, part in p.items():
        if "error" in part:
            add(f"part {name}", part["error"], "runs", False)
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(res: dict) -> str:
    v, p = res["versions"], res["parts"]
    lines = [f"pyfast bench gpu on {res['device']}{' (--small: not a target run)' * res['small']}"
             f"; {res['machine']}; {res['date']}",
             "versions: " + ", ".join(f"{k} {v[k]}" for k in sorted(v))]
    r = p.get("roof", {})
    if "GBps" in r:
        lines.append(f"roof: copy of {r['bytes'] / 2**30:.2f} GiB moved at {r['GBps']:.0f} GB/s"
                     + (f"; datasheet {res['datasheet_GBps']:.0f} GB/s"
                        if res.get("datasheet_GBps") else ""))
    for row in p.get("quantize", {}).get("rows", []):
        lines.append(f"  {row['kind']:8s} {row['backend']:7s} compress {row['compress_s'] * 1e6:9.1f} "
                     f"us ({_pct(row['compress_roof'])} roof)  decompress {row['decompress_s'] * 1e6:9.1f}"
                     f" us ({_pct(row['decompress_roof'])})  both {row['GBps']:7.1f} GB/s = "
                     f"{_pct(row['roof'])} roof, {_pct(row['sheet'])} datasheet")
    t = p.get("topk", {})
    for row in t.get("rows", []):
        reads = "-" if row.get("reads") is None else f"{row['reads']:.2f}"
        lines.append(f"  top-k 1% of {t['numel']:,}: {row['impl']:22s} {row['us']:10.1f} us  "
                     f"{row['input_GBps']:7.1f} GB/s of input  reads {reads}")
    for row in p.get("linear", {}).get("rows", []):
        lines.append(f"  linear_act {row['M']}x{row['K']}x{row['N']} {row['dtype']}: "
                     f"{row['fused_TFLOPS']:.1f} TFLOPS, {row['vs_gemm']:.2f}x GEMM alone, "
                     f"{row['vs_separate']:.2f}x GEMM + GELU")
    for row in p.get("attention", {}).get("rows", []):
        lines.append(f"  attention S={row['S']} D={row['D']} {row['dtype']}: pyfast "
                     f"{row['pyfast_TFLOPS']:.1f} TFLOPS, sdpa {row['sdpa_TFLOPS']:.1f} "
                     f"({row['vs_sdpa']:.2f}x)")
    o = p.get("overlap", {})
    if "compute_slowdown" in o:
        lines.append(f"  overlap: matmuls {o['matmul_s'] * 1e3:.2f} ms alone, "
                     f"{o['matmul_with_allreduce_s'] * 1e3:.2f} beside the all-reduces "
                     f"({100 * o['compute_slowdown']:+.1f}%); all-reduces alone "
                     f"{o['allreduce_s'] * 1e3:.2f} ms")
    for name, part in p.items():
        if "error" in part:
            lines.append(f"  {name}: {part['error']}")
    lines.append("targets:")
    for tg in res["targets"]:
        verdict = {True: "met", False: "MISSED", None: "(cpu)"}[tg["met"]]
        lines.append(f"  {tg['target']}: {tg['measured']} (goal {tg['goal']}) {verdict}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="pyfast bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda[:N], or cpu with --small")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument("--small", action="store_true",
                    help="CPU-sized inputs (the tests' check of the script, not a target run)")
    ap.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = ap.parse_args(argv)
    parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {', '.join(bad)}; known: {', '.join(PARTS)}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: torch sees no CUDA device here (a CPU check: "
                 "--device cpu --small)")
    if a.device == "cpu" and not a.small:
        ap.error("--device cpu needs --small: the full sizes are a GPU's (1 GiB copies, 64M "
                 "elements)")
    return perf.finish(run(a.device, parts, a.small), table, a.out)
