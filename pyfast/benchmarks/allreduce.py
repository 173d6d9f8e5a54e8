"""Compressed all-reduce on plain and emulated links (`pyfast bench allreduce`).

Each (world, link) runs `world` gloo ranks (subprocesses, one torch thread each) inside a
namespace whose lo is shaped by tc tbf (see netns.py). Per compressor spec: median over repeats
of the slowest rank's time (ranks leave a barrier before each call), the payload per rank, the
bytes that crossed lo (read from the namespace's counters around the timed calls), the link
floor = bytes sent by all ranks / rate (both directions share the one qdisc), and speedups vs
the plain fp32 and the fp16 all-reduce measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import pyfast
import pyfast.compress as C
from pyfast import perf
from pyfast._io import atomic_write_text
from pyfast import netns
from pyfast.benchmarks.compress import gradient

SPECS = ["none", "fp16", "bf16", "int8", "int4", "fp8", "sign", "topk:0.01", "randomk:0.01",
         "powersgd:4"]
# Issue 3, on the 1 Gbit/s link: (spec, baseline, minimum speedup); each within its bar of its
# link floor: 25% (issue 3) for int8, 1.5x for top-k (issue 25 set that bar: a data-dependent
# selection and a sparse all-gather, measured 2.4-4.3x before, 1.16-1.17x after its fix)
TARGETS = [("int8", "none", 3.0), ("int8", "fp16", 1.5), ("topk:0.01", "none", 15.0)]
TARGET_LINK, FLOOR_SLACK = "1gbit", {"int8": 1.25, "topk:0.01": 1.5}


def wire_bytes(algo: str, world: int, payloads: list[int]) -> int:
    """Bytes all ranks send for one call. gloo's all-reduce and all-gather are rings: an
    all-gather sends W-1 buffers (padded to the largest) per rank; a ring all-reduce, or
    two-phase's all-to-all + all-gather, 2(W-1)/W of one. The namespace's lo counted 0.1-0.4%
    more (TCP/IP headers, barriers) for every spec at W=2 and 4, 64 MB, 1gbit."""
    if algo in ("allgather", "sparse-allgather"):
        return world * (world - 1) * max(payloads)
    return 2 * (world - 1) * max(payloads)


def _worker() -> None:
    """One rank: env as torchrun sets it, the job in PYFAST_ALLREDUCE (json)."""
    import torch
    import torch.distributed as dist

    from pyfast.comm import all_reduce, choose
    job = json.loads(os.environ["PYFAST_ALLREDUCE"])
    torch.set_num_threads(1)  # one core per rank; the machine has 2
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["pg_timeout"]))
    world, rank = dist.get_world_size(), dist.get_rank()
    x = gradient(job["numel"], seed=rank)  # (4096, -1): PowerSGD's matrix; the rest flatten it
    t = torch.empty_like(x)
    warm, reps, rows = job["warmup"], job["repeats"], []
    for spec in job["specs"]:
        c = C.get(spec)
        payload = c.compress(x, "probe").nbytes
        times = []
        for i in range(warm + reps):
            t.copy_(x)  # in place: a fresh input each call (sums would grow, fp16 overflow)
            dist.barrier()
            if i == warm:
                sent0 = netns.lo_tx_bytes()
            t0 = perf.clock(t.device)
            all_reduce(t, c, name="g")
            times.append(perf.clock(t.device) - t0)
        dist.barrier()
        sent = (netns.lo_tx_bytes() - sent0) / reps  # rank 0's view = the whole namespace
        each = [None] * world
        dist.all_gather_object(each, (times[warm:], payload, sent))
        if rank == 0:
            per_call = sorted(max(ts) for ts in zip(*(e[0] for e in each)))
            algo = choose(c, x.numel(), world)
            rows.append({"spec": spec, "algorithm": algo, **perf.summary(per_call),
                         "payload_bytes": max(e[1] for e in each),
                         "wire_bytes": wire_bytes(algo, world, [e[1] for e in each]),
                         "link_bytes": sent if os.environ.get("PYFAST_NETNS") else None})
    if rank == 0:
        atomic_write_text(job["out"], json.dumps(rows))
    netns.finish_group()


def _mirror() -> None:
    """A peer rank for a caller that is rank 0 in its own process (bench/test_bench_allreduce:
    pytest-benchmark times rank 0's call): takes each spec rank 0 broadcasts and does the same
    all-reduce on its own gradient (seed = rank); None ends it. The job in PYFAST_ALLREDUCE."""
    import torch
    import torch.distributed as dist

    from pyfast.comm import all_reduce
    job = json.loads(os.environ["PYFAST_ALLREDUCE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["pg_timeout"]))
    x = gradient(job["numel"], seed=dist.get_rank())
    t = torch.empty_like(x)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        t.copy_(x)
        dist.barrier()
        all_reduce(t, box[0], name="g")
    netns.finish_group()


def _derive(rows: list[dict], world: int, link: str) -> list[dict]:
    bps = netns.rate_bps(link)
    by = {r["spec"]: r["median_s"] for r in rows}
    for r in rows:
        r.update(world=world, link=link)
        r["floor_s"] = r["wire_bytes"] * 8 / bps if bps else None
        r["floor_fraction"] = r["floor_s"] / r["median_s"] if bps else None
        for base in ("none", "fp16"):
            r[f"vs_{base}"] = by[base] / r["median_s"] if base in by else None
    return rows


def run(worlds=(2, 4), links=netns.LINKS, numel: int = 1 << 24, specs=SPECS,
        repeats: int = 5, warmup: int = 1, timeout: float = 1800, note: str = "") -> dict:
    rows = []
    for link in links:
        netns.rate_bps(link)  # a bad link string fails before anything runs
        for world in worlds:
            with tempfile.TemporaryDirectory() as d:
                job = {"numel": numel, "specs": list(specs), "repeats": repeats,
                       "warmup": warmup, "pg_timeout": timeout, "out": os.path.join(d, "r.json")}
                try:
                    netns.run_ranks(["-c", "from pyfast.benchmarks.allreduce import _worker; "
                                     "_worker()"], world, link, timeout,
                                    env={"PYFAST_ALLREDUCE": json.dumps(job)})
                except netns.LinkUnavailable as e:
                    rows.append({"world": world, "link": link, "skipped": str(e)})
                    continue
                with open(job["out"]) as f:
                    rows += _derive(json.load(f), world, link)
    result = {"machine": perf.machine(), "ranks": "one process per rank, 1 torch thread each",
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "pyfast": pyfast.__version__, "numel": numel, "repeats": repeats, "note": note,
              "links": {k: netns.rate_bps(k) for k in links}, "rows": rows}
    result["targets"] = targets(result)
    return result


def targets(result: dict) -> list[str]:
    """One line per issue-3 target and measured (world, link): met or missed, by how much."""
    out = []
    for world in sorted({r["world"] for r in result["rows"] if r["link"] == TARGET_LINK}):
        got = {r["spec"]: r for r in result["rows"]
               if r["link"] == TARGET_LINK and r["world"] == world and "median_s" in r}
        for spec, base, want in TARGETS:
            if spec in got and base in got:
                x = got[base]["median_s"] / got[spec]["median_s"]
                out.append(f"{'met   ' if x >= want else 'MISSED'} W={world} {spec} vs {base}: "
                           f"{x:.2f}x (target {want:g}x)")
        for spec, bar in FLOOR_SLACK.items():
            if spec in got:
                k = got[spec]["median_s"] / got[spec]["floor_s"]
                out.append(f"{'met   ' if k <= bar else 'MISSED'} W={world} {spec}: "
                           f"{k:.2f}x its floor (target <= {bar}x)")
    return out


def _ms(s):
    return "-" if s is None else f"{s * 1e3:.1f}"


def table(result: dict):
    from rich.table import Table
    t = Table(title=f"all-reduce of {result['numel']:,} fp32 elements ({result['numel'] * 4 / 2**20:.0f}"
                    f" MB), median of {result['repeats']}, slowest rank\n{result['machine']}; "
                    f"{result['ranks']}; {result['date']}")
    cols = ("W", "link", "spec", "algorithm", "payload MB/rank", "wire MB (all)", "lo MB",
            "ms", "q10-q90 ms", "floor ms", "% floor", "vs fp32", "vs fp16")
    perf.columns(t, cols, left=("link", "spec", "algorithm"))
    prev, skipped = None, []
    for r in result["rows"]:
        if "skipped" in r:
            skipped.append(f"W={r['world']} {r['link']}: not run, {r['skipped']}")
            continue
        if prev is not None and prev != (r["world"], r["link"]):
            t.add_section()
        prev = (r["world"], r["link"])
        mb = lambda b: "-" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
        x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        t.add_row(str(r["world"]), r["link"], r["spec"], r["algorithm"], mb(r["payload_bytes"]),
                  mb(r["wire_bytes"]), mb(r["link_bytes"]), _ms(perf.stat(r, "median_s")),
                  f"{_ms(r['q10_s'])}-{_ms(r['q90_s'])}", _ms(r["floor_s"]),
                  "-" if r["floor_fraction"] is None else f"{100 * r['floor_fraction']:.0f}%",
                  x(r["vs_none"]), x(r["vs_fp16"]))
    lines = skipped + result.get("targets", []) + ([f"note: {result['note']}"] if result["note"] else [])
    t.caption_justify = "left"
    t.caption = "\n".join(lines + ["lo MB: measured on the namespace's lo (loopback: host lo is "
                                   "shared, not measured); floor = wire / rate"])
    return t


def save(result: dict, out: str) -> None:
    perf.save_result(result, out, table, width=200)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench allreduce", description=__doc__.split("\n")[0])
    p.add_argument("--world", default="2,4", help="comma-separated world sizes (default 2,4)")
    p.add_argument("--link", default=",".join(netns.LINKS),
                   help="comma-separated: loopback or a tc rate like 1gbit (default: all three)")
    p.add_argument("--numel", type=int, default=1 << 24, help="elements (default 16M = 64 MB)")
    p.add_argument("--specs", default="", help="comma-separated specs (default: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per (world, link)")
    p.add_argument("--note", default="", help="recorded with the results (e.g. 'under load')")
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    try:
        worlds = [int(w) for w in a.world.split(",")]
        links = a.link.split(",")
        [netns.rate_bps(k) for k in links]
        specs = [C.get(s).spec and s for s in a.specs.split(",")] if a.specs else SPECS
    except ValueError as e:
        p.error(str(e))
    if a.numel < 1 or a.repeats < 1 or min(worlds) < 2:
        p.error("--numel and --repeats must be >= 1, --world >= 2")
    result = run(worlds, links, a.numel, specs, a.repeats, timeout=a.timeout, note=a.note)
    from rich.console import Console
    Console(width=200).print(table(result))
    if a.out:
        save(result, a.out)
        print(f"wrote {a.out}.json and {a.out}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
