"""nf4 quantize / dequantize: the torch reference vs the C++ kernels on a weight-like tensor
(Gaussian), throughput and bytes a parameter against bf16 (a frozen LoRA base, QLoRA's
blocks of 64). int4 at the same block is the C++ baseline: the same bytes, a linear code.

    pyfast bench nf4_ops [--numel N] [--repeats R] [--block B] [--out bench/results/nf4_ops]
"""
import os
import sys

import torch

from pyfast import perf
from pyfast.ops import quantize


def run(numel: int = 1 << 24, repeats: int = 5, block: int = 64) -> dict:
    load0 = os.getloadavg()[0]  # the machine is shared: say how busy it was
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g) * 0.02  # an initialised weight's scale
    codes, scales = quantize.quantize(x, "nf4", block)
    packed = codes.numel() + 4 * scales.numel()
    rows = []
    for kind in ("nf4", "int4"):
        for backend in ("torch", "cpp") if kind == "nf4" else ("cpp",):
            c, s = quantize.quantize(x, kind, block, backend=backend)
            ops = {
                "quantize": (lambda: quantize.quantize(x, kind, block, backend=backend),
                             4 * numel + packed),
                "dequantize fp32": (lambda: quantize.dequantize(c, s, numel, kind, block,
                                                                torch.float32, backend=backend),
                                    packed + 4 * numel),
                "dequantize bf16": (lambda: quantize.dequantize(c, s, numel, kind, block,
                                                                torch.bfloat16, backend=backend),
                                    packed + 2 * numel),
            }
            for op, (fn, nbytes) in ops.items():
                t = perf.summary(perf.times(fn, repeats))
                rows.append({"kind": kind, "backend": backend, "op": op, "bytes": nbytes,
                             "gb_per_s": nbytes / t["median_s"] / 1e9, **t})
    y = quantize.dequantize(codes, scales, numel, "nf4", block)
    return {"machine": perf.machine(), "numel": numel, "repeats": repeats, "block": block,
            "copy_gb_per_s": perf.copy_bandwidth(x, repeats) / 1e9,
            "nf4_bytes_per_param": packed / numel, "bf16_bytes_per_param": 2.0,
            "nf4_vs_bf16": 2.0 * numel / packed, "nf4_bits_per_param": 8 * packed / numel,
            "nf4_rel_err": float((y - x).norm() / x.norm()),
            "load_avg_1m": [load0, os.getloadavg()[0]], "rows": rows}


def table(r: dict) -> str:
    lines = [f"nf4 ops, {r['numel']:,} fp32 elements, block {r['block']}, medians of "
             f"{r['repeats']}, {r['machine']}",
             f"nf4: {r['nf4_bytes_per_param']:.4f} bytes a parameter ({r['nf4_bits_per_param']:.3f} "
             f"bits) vs bf16 2: {r['nf4_vs_bf16']:.3f}x fewer; round-trip relative error "
             f"{r['nf4_rel_err']:.4f}; fp32 copy {r['copy_gb_per_s']:.1f} GB/s (read + write)",
             f"{'kind':5s} {'backend':7s} {'op':16s} {'median ms':>10s} {'q10 ms':>8s} "
             f"{'q90 ms':>8s} {'GB/s':>6s}"]
    for w in r["rows"]:
        lines.append(f"{w['kind']:5s} {w['backend']:7s} {w['op']:16s} {w['median_s'] * 1e3:10.2f} "
                     f"{w['q10_s'] * 1e3:8.2f} {w['q90_s'] * 1e3:8.2f} {w['gb_per_s']:6.2f}")
    lines.append("GB/s: bytes read + written (fp32 input or output, codes and fp32 scales) / "
                 f"median; 1-minute load average {r['load_avg_1m'][0]:.1f} before, "
                 f"{r['load_avg_1m'][1]:.1f} after")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="pyfast bench nf4_ops", description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    if a.numel < 1 or a.repeats < 1:
        p.error("--numel and --repeats must be >= 1")
    return perf.finish(run(a.numel, a.repeats, a.block), table, a.out)


if __name__ == "__main__":
    sys.exit(main())
