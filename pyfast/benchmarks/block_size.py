"""Choose the quantizers' default block size: error, scale overhead and C++ throughput per
block on a 16M-element gradient-like tensor.

    pyfast bench block_size [--numel N] [--out bench/results/block_size]
"""
import sys

from pyfast import perf
from pyfast.benchmarks.compress import gradient
from pyfast.ops import quantize

BLOCKS = [64, 128, 256, 512, 1024, 2048, 4096]
KINDS = ("int8", "int4", "fp8", "sign")


def run(numel: int = 1 << 24, repeats: int = 5) -> dict:
    x = gradient(numel).view(-1)
    rows = []
    for kind in KINDS:
        for b in BLOCKS:
            codes, scales = quantize.quantize(x, kind, b)
            y = quantize.dequantize(codes, scales, numel, kind, b)
            s = perf.summary(perf.times(
                lambda: quantize.dequantize(*quantize.quantize(x, kind, b), numel, kind, b),
                repeats, device=x.device))
            rows.append({"kind": kind, "block": b, "rel_err": float((y - x).norm() / x.norm()),
                         "wire_ratio": numel * 4 / (codes.numel() + 4 * scales.numel()), **s})
    return {"machine": perf.machine(), "numel": numel, "repeats": repeats, "rows": rows}


def table(result: dict) -> str:
    lines = [f"block size sweep, {result['numel']:,} fp32 elements, {result['machine']}",
             f"{'kind':5s} {'block':>6s} {'rel err':>8s} {'wire x':>7s} {'q+dq ms':>8s}"]
    for r in result["rows"]:
        lines.append(f"{r['kind']:5s} {r['block']:6d} {r['rel_err']:8.4f} {r['wire_ratio']:7.2f} "
                     f"{r['median_s'] * 1e3:8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="pyfast bench block_size", description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    if a.numel < 1 or a.repeats < 1:
        p.error("--numel and --repeats must be >= 1")
    return perf.finish(run(a.numel, a.repeats), table, a.out)


if __name__ == "__main__":
    sys.exit(main())
