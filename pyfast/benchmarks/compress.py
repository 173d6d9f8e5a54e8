"""Compressor throughput, wire ratio and error per backend (`pyfast bench compress`).

"decompress" returns a new tensor: at 16M fp32 that is 64 MB of fresh pages, and their page
faults alone cost ~25 ms on this VM (an empty tensor + fill 27.8 ms vs 2.0 ms into an existing
one; torch's own `x * 2` pays the same). "into" is decompress(p, out=buf): the same values
decoded into an existing tensor, which is what the collectives do with a bucket's slices;
both are timed side by side and "into x" is their ratio.

Bytes moved by compress + decompress = read x + write payload + read payload + write y; the
fraction of the memory roof compares that rate with y.copy_(x) (read + write) in the same run.
"""
from __future__ import annotations

import datetime
import os

import torch

import pyfast
import pyfast.compress as C
from pyfast import perf
from pyfast.ops import status
from pyfast.ops import topk

SPECS = ["none", "fp16", "bf16", "fp8", "int8", "int4", "sign", "topk:0.01", "randomk:0.01",
         "powersgd:4"]
KERNEL_SPECS = {"fp8", "int8", "int4", "sign", "topk:0.01"}  # the ones with C++/Triton kernels


def gradient(numel: int, seed: int = 0) -> torch.Tensor:
    """Gradient-like: Gaussian with a log-normal spread of magnitudes, as a (4096, -1) matrix
    (PowerSGD needs a matrix; the rest flatten it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g).clamp(-2, 2))
    rows = 4096 if numel % 4096 == 0 else 1
    return x.view(rows, -1)


def backends_for(spec: str, device: torch.device = torch.device("cpu")
                 ) -> list[tuple[str, bool, str]]:
    if spec not in KERNEL_SPECS:
        return [("torch", True, "")]
    out = []
    for b in ("torch", "cpp", "triton"):
        ok, why = status(b, device)
        if b == "triton" and ok and device.type == "cpu":
            ok, why = False, "CUDA only; on CPU its interpreter is tested, not timed"
        out.append((b, ok, why))
    return out


def run(numel: int = 1 << 24, specs=SPECS, repeats: int = 5, device: str = "cpu") -> dict:
    load0 = os.getloadavg()[0]
    x = gradient(numel).to(device)  # drawn on the CPU: the same values on every device
    xb = x.numel() * x.element_size()
    roof = perf.copy_bandwidth(x, repeats)
    rows = []
    for spec in specs:
        ref_time = None
        for b, ok, why in backends_for(spec, x.device):
            row = {"spec": spec, "backend": b}
            if not ok:
                rows.append({**row, "skipped": why})
                continue
            c = C.get(spec)
            with perf.backend(b):
                p = c.compress(x, "g")
                tc, _, _ = perf.median_time(lambda: c.compress(x, "g"), repeats, device=x.device)
                td, _, _ = perf.median_time(lambda: c.decompress(p), repeats, device=x.device)
                y = c.decompress(p)
                out = torch.empty_like(x)
                c.decompress(p, out=out)  # first touch of its pages: not timed
                into_s, _, _ = perf.median_time(lambda: c.decompress(p, out=out), repeats,
                                                device=x.device)
            t = tc + td
            moved = 2 * xb + 2 * p.nbytes
            ref_time = t if b == "torch" else ref_time
            r = {**row, "compress_s": tc, "decompress_s": td, "wire_ratio": xb / p.nbytes,
                 "rel_error": float((y - x).norm() / x.norm()), "GBps": moved / t / 1e9,
                 "roof_fraction": moved / t / roof,
                 "speedup_vs_torch": ref_time / t if ref_time else None}
            r["into_s"] = into_s  # the same bytes as decompress, into existing pages
            r["into_speedup"] = td / into_s
            r["into_roof_fraction"] = moved / (tc + into_s) / roof
            rows.append(r)
    k = topk.target(numel, 0.01)[0]
    t_topk, _, _ = perf.median_time(lambda: torch.topk(x.view(-1).abs(), k), repeats,
                                    device=x.device)
    for r in rows:
        if r["spec"] == "topk:0.01" and "compress_s" in r:
            r["speedup_vs_torch_topk"] = t_topk / r["compress_s"]
    return {"machine": perf.machine(), "device": str(x.device), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_average": [load0, os.getloadavg()[0]],  # a shared machine: say how shared
            "pyfast": pyfast.__version__, "numel": numel, "copy_GBps": roof / 1e9,
            "torch_topk_s": t_topk, "rows": rows}


def table(result: dict):
    from rich.table import Table
    load = result.get("load_average")
    on = f" on {result['device']}" if result.get("device", "cpu") != "cpu" else ""
    t = Table(title=f"compress + decompress, {result['numel']:,} fp32 elements{on}\n"
                    f"{result['machine']}" + (f" (load {load[0]:.1f}-{load[1]:.1f})" if load else "")
                    + f"; copy roof {result['copy_GBps']:.1f} GB/s (read+write); "
                    f"torch.topk(|x|, 1%) {result['torch_topk_s'] * 1e3:.1f} ms")
    perf.columns(t, ("spec", "backend", "wire x", "rel err", "compress ms", "decompress ms",
                     "GB/s", "% roof", "into ms", "into x", "% roof (into)", "vs torch"),
                 left=("spec", "backend"))
    skipped = {}
    for r in result["rows"]:
        if "skipped" in r:
            skipped.setdefault(f"{r['backend']}: {r['skipped']}", []).append(r["spec"])
            continue
        if r["spec"] == "none":  # a view: nothing is moved, so no rate to show
            r = {**r, "GBps": float("nan"), "roof_fraction": float("nan"),
                 "into_roof_fraction": float("nan")}
        vs = f"{r['speedup_vs_torch']:.1f}x" if r["backend"] != "torch" else ""
        if "speedup_vs_torch_topk" in r:
            vs += f" ({r['speedup_vs_torch_topk']:.1f}x torch.topk)"
        t.add_row(r["spec"], r["backend"], f"{r['wire_ratio']:.1f}", f"{r['rel_error']:.4f}",
                  f"{r['compress_s'] * 1e3:.1f}", f"{r['decompress_s'] * 1e3:.1f}",
                  f"{r['GBps']:.1f}", f"{100 * r['roof_fraction']:.0f}%",
                  f"{r['into_s'] * 1e3:.1f}", f"{r['into_speedup']:.1f}",
                  f"{100 * r['into_roof_fraction']:.0f}%", vs)
    t.caption = "\n".join(f"not run, {why} ({', '.join(specs)})" for why, specs in skipped.items())
    return t


def save(result: dict, out: str) -> None:
    perf.save_result(result, out, table, width=160)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="pyfast bench compress", description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 24, help="elements (default 16M)")
    p.add_argument("--specs", default="", help="comma-separated specs (default: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (cpp = pyfast._C's CUDA "
                   "kernels there, triton = the compiled Triton kernels)")
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: torch sees no CUDA device here")
    if a.numel < 1:
        p.error("--numel must be >= 1")
    result = run(a.numel, a.specs.split(",") if a.specs else SPECS, a.repeats, a.device)
    return perf.finish(result, table, a.out, width=160)