"""Choose the quantizers' default block size: error, scale overhead and C++ throughput per
block on a 16M-element gradient-like tensor. Writes bench/results/block_size.txt.

    .venv/bin/python bench/block_size.py
"""
import sys

import torch

from pyfast import perf
from pyfast._io import atomic_write_text
from pyfast.benchmarks.compress import gradient
from pyfast.ops import quantize as Q

BLOCKS = [64, 128, 256, 512, 1024, 2048, 4096]


def main(numel=1 << 24, out="bench/results/block_size.txt"):
    x = gradient(numel).view(-1)
    lines = [f"block size sweep, {numel:,} fp32 elements, {perf.machine()}",
             f"{'kind':5s} {'block':>6s} {'rel err':>8s} {'wire x':>7s} {'q+dq ms':>8s}"]
    for kind in ("int8", "int4", "fp8", "sign"):
        for b in BLOCKS:
            codes, scales = Q.quantize(x, kind, b)
            y = Q.dequantize(codes, scales, numel, kind, b)
            err = float((y - x).norm() / x.norm())
            wire = numel * 4 / (codes.numel() + 4 * scales.numel())
            t, _, _ = perf.median_time(
                lambda: Q.dequantize(*Q.quantize(x, kind, b), numel, kind, b), 5)
            lines.append(f"{kind:5s} {b:6d} {err:8.4f} {wire:7.2f} {t * 1e3:8.1f}")
    text = "\n".join(lines)
    print(text)
    atomic_write_text(out, text + "\n")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
