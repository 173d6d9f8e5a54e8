"""ZeRO-3 with offload="params" (prefetch 1 and 2) vs offload="optimizer" vs no offload, side by
side on `pyfast bench zero`'s harness (issue 34, item 3; docs/offload.md). On a CPU-only machine
host and device are the same memory: this measures the offload's bookkeeping (the host -> device
copies of each unit's shard before its gather, the gradient copies out), not PCIe.

    PYTHONPATH=. flock /work/bench.lock python bench/zero3_offload_params.py \
        bench/results/zero3_offload_params_a
"""
import datetime
import json
import sys

from pyfast.benchmarks import zero as Z
from pyfast.benchmarks.zero_offload import MODEL

CONFIGS = ["pyfast zero3", "pyfast zero3 offload", "pyfast zero3 offload params",
           "pyfast zero3 offload params p2"]


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")


def main(out: str) -> None:
    res = Z.run(links=("loopback",), configs=CONFIGS, batch=2, seq=128, steps=20, warmup=3,
                mem_steps=2, model=MODEL)
    base = next(r["median_s"] for r in res["rows"] if r["config"] == "pyfast zero3")
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"ZeRO-3 step, offload none / optimizer / params (prefetch 1, 2), 2 gloo ranks x 1 "
             f"thread, gpt-small shape {MODEL}, AdamW (torch), batch 2 x 128 tokens/rank, median "
             f"of 20 steps after 3, slowest rank, round robin; {_cpu()}, 2 cores, {when}; other "
             "helpers' niced jobs on the box; host = device memory here (CPU)"]
    for r in res["rows"]:
        r["vs_zero3"] = r["median_s"] / base
        lines.append(f"{r['config']:34s} step {r['median_s'] * 1e3:8.1f} ms  q10-q90 "
                     f"{r['q10_s'] * 1e3:.0f}-{r['q90_s'] * 1e3:.0f}  x zero3 {r['vs_zero3']:.3f}"
                     f"  loss0 diff {r.get('loss0_diff', 0):.1e}")
    lines += ["memory " + json.dumps(m) for m in res.get("memory", [])]
    with open(out + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
