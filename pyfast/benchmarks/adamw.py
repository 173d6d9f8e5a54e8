"""pyfast's C++ AdamW (pyfast.ops.adamw_, the pass pyfast.optim.AdamW runs) vs torch.optim.AdamW's
foreach and fused CPU paths, side by side on the same tensors, and against the memory roof.

Each size is split into 16 tensors of ragged (odd) sizes, like a model's parameters; the three
providers step the same p, g, m, v through torch's functional API (torch.optim.adamw.adamw) and
pyfast.ops.adamw_, so a 500M case holds one set (8 GB fp32) instead of three. The roof: an
AdamW step must read p, g, m, v and write p, m, v (28 bytes a fp32 parameter, 22 with bf16 p
and g) at the bandwidth of an in-place STREAM-add-like pass measured here with the same threads
(a.add_(b): read a and b, write a, 12 bytes an element). An out-of-place copy (also recorded)
reads the destination's lines before writing them, a third stream that a byte count of read +
write leaves out and AdamW (in place) does not pay: it understates the roof by ~1.5x.

    pyfast bench adamw [--sizes 10M,50M,100M,500M] [--bf16-sizes 10M,50M] [--repeats 5]
                       [--threads 2] [--out bench/results/adamw]
"""
import os
import sys

import torch
from torch.optim.adamw import adamw as torch_adamw

from pyfast import perf
from pyfast.ops.adamw import adamw_

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
PROVIDERS = ("pyfast", "torch foreach", "torch fused")


def ragged(n: int, parts: int = 16) -> list[int]:
    """`parts` odd sizes summing to n: shares 0.5..1.5 of the mean, the last takes the rest."""
    g = torch.Generator().manual_seed(n)
    w = 0.5 + torch.rand(parts, generator=g, dtype=torch.float64)
    sizes = [int(n * float(x) / float(w.sum())) | 1 for x in w[:-1]]
    return sizes + [n - sum(sizes)]


def tensors(n: int, dtype: torch.dtype):
    ps, gs, ms, vs = [], [], [], []
    for k in ragged(n):
        ps.append(torch.empty(k, dtype=dtype).uniform_(-1, 1))  # randn of 2 GB takes ~10 s here
        gs.append(torch.empty(k, dtype=dtype).uniform_(-1e-2, 1e-2))
        ms.append(torch.zeros(k))
        vs.append(torch.zeros(k))
    return ps, gs, ms, vs


def steppers(ps, gs, ms, vs, dtype):
    count = [0]

    def ours():
        count[0] += 1
        adamw_(ps, gs, ms, vs, step=count[0], **HP)

    def torch_path(**kw):
        # torch's state for bf16 params is bf16 moments: give it its own (fused/foreach group by
        # dtype), the bytes it really moves
        m2 = ms if dtype == torch.float32 else [m.to(dtype) for m in ms]
        v2 = vs if dtype == torch.float32 else [v.to(dtype) for v in vs]
        steps = [torch.tensor(0.0) for _ in ps]
        return lambda: torch_adamw(
            ps, gs, m2, v2, [], steps, amsgrad=False, maximize=False, lr=HP["lr"],
            beta1=HP["beta1"], beta2=HP["beta2"], eps=HP["eps"],
            weight_decay=HP["weight_decay"], **kw)

    return {"pyfast": ours, "torch foreach": torch_path(foreach=True),
            "torch fused": torch_path(fused=True)}


def inplace_bandwidth(x: torch.Tensor, repeats: int) -> float:
    """Bytes a second of a.add_(b) (read a, b; write a in place): the roof's bandwidth."""
    a, b = x.clone(), x.clone()
    t = perf.summary(perf.times(lambda: a.add_(b), repeats))["median_s"]
    return 12 * x.numel() / t


def measure(n: int, dtype: torch.dtype, repeats: int, roof_bw: float) -> dict:
    ps, gs, ms, vs = tensors(n, dtype)
    fns = steppers(ps, gs, ms, vs, dtype)
    ts = {name: [] for name in fns}
    for name in fns:
        fns[name]()  # warm-up: first touch of the states, torch's lazy init
    for _ in range(repeats):  # interleaved: a busy neighbour slows every provider alike
        for name, fn in fns.items():
            ts[name] += perf.times(fn, 1, warmup=0)
    per_param = 28 if dtype == torch.float32 else 22
    roof_s = per_param * n / roof_bw
    rows = {name: {**perf.summary(t), "gb_per_s": per_param * n / perf.summary(t)["median_s"]
                   / 1e9} for name, t in ts.items()}
    med = {name: r["median_s"] for name, r in rows.items()}
    return {"numel": n, "dtype": str(dtype).replace("torch.", ""), "tensors": len(ps),
            "bytes_per_param": per_param, "roof_s": roof_s, "rows": rows,
            "speedup_vs_foreach": med["torch foreach"] / med["pyfast"],
            "speedup_vs_fused": med["torch fused"] / med["pyfast"],
            "fused_of_roof": roof_s / med["torch fused"], "pyfast_of_roof": roof_s / med["pyfast"]}


def parse_size(s: str) -> int:
    mult = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
    s = s.strip().upper()
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def run(sizes, bf16_sizes, repeats: int = 5, threads: int = 2, roof_numel: int = 1 << 26) -> dict:
    torch.set_num_threads(threads)
    load0 = os.getloadavg()[0]  # the machine is shared: say how busy it was
    x = torch.empty(roof_numel).uniform_()  # 2^26: 256 MB, far past the caches
    copy_bw = perf.copy_bandwidth(x, max(repeats, 5))
    roof_bw = inplace_bandwidth(x, max(repeats, 5))
    cases = [measure(n, torch.float32, repeats, roof_bw) for n in sizes]
    cases += [measure(n, torch.bfloat16, repeats, roof_bw) for n in bf16_sizes]
    return {"machine": perf.machine(), "threads": threads, "repeats": repeats,
            "copy_gb_per_s": copy_bw / 1e9, "inplace_gb_per_s": roof_bw / 1e9, "cases": cases,
            "load_avg_1m": [load0, os.getloadavg()[0]]}


def table(r: dict) -> str:
    lines = [f"AdamW step, medians of {r['repeats']} after a warm-up, {r['machine']}",
             f"roof = bytes a step must move / in-place a.add_(b) bandwidth "
             f"{r['inplace_gb_per_s']:.1f} GB/s (out-of-place copy, read + write counted: "
             f"{r['copy_gb_per_s']:.1f} GB/s)",
             f"{'params':>6s} {'dtype':8s} {'provider':13s} {'median ms':>10s} {'q10 ms':>8s} "
             f"{'q90 ms':>8s} {'GB/s':>6s} {'roof ms':>8s}"]
    for c in r["cases"]:
        for name, w in c["rows"].items():
            lines.append(f"{c['numel'] / 1e6:5.0f}M {c['dtype']:8s} {name:13s} "
                         f"{w['median_s'] * 1e3:10.1f} {w['q10_s'] * 1e3:8.1f} "
                         f"{w['q90_s'] * 1e3:8.1f} {w['gb_per_s']:6.2f} {c['roof_s'] * 1e3:8.1f}")
        lines.append(f"{'':6s} {c['dtype']:8s} pyfast {c['speedup_vs_foreach']:.2f}x foreach, "
                     f"{c['speedup_vs_fused']:.2f}x fused; of the roof: pyfast "
                     f"{c['pyfast_of_roof']:.0%}, fused {c['fused_of_roof']:.0%}")
    lines.append(f"GB/s: {r['cases'][0]['bytes_per_param']} bytes a fp32 parameter (22 with "
                 "bf16 p and g: pyfast keeps fp32 moments; torch's bf16 rows keep bf16 moments "
                 "and move 14) / median; 1-minute load average "
                 f"{r['load_avg_1m'][0]:.1f} before, {r['load_avg_1m'][1]:.1f} after")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="pyfast bench adamw", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10M,50M,100M,500M")
    p.add_argument("--bf16-sizes", default="10M,50M")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    bf16 = [parse_size(s) for s in a.bf16_sizes.split(",") if s]
    if a.repeats < 1 or a.threads < 1 or any(n < 16 for n in sizes + bf16):
        p.error("--repeats and --threads must be >= 1, sizes >= 16")
    return perf.finish(run(sizes, bf16, a.repeats, a.threads), table, a.out)


if __name__ == "__main__":
    sys.exit(main())
