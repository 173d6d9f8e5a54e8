"""Context parallelism (`pyfast bench cp`): causal attention forward + backward over one long
sequence on 2 ranks x 1 thread (pyfast.parallel.context: ring attention, zigzag and contiguous
layouts; DeepSpeed-Ulysses) against one process with one and two threads (SDPA on the whole
sequence: aten's CPU flash kernel), on loopback and an emulated link; peak memory per rank.

Problem (defaults): B=1, H=4, D=64, fp32, 4096-32768 tokens; q, k, v and dout come from one seed
on every rank and are sharded (shard_sequence) before anything is timed. A sample is forward +
backward; per repeat the slowest rank's (a barrier before each), median over repeats, providers
in turns (round robin). One process runs in a 1-rank launch per thread count (clean threads and
memory; no link). First, every 2-rank provider's out, dq, dk, dv at the smallest length must
equal dense SDPA's within TOL of their largest magnitude, or the run aborts.

Ring: `exposed` = seconds fwd + bwd waited on transfers (ring_attention.last_wait, max over
ranks; a wait also covers a peer still computing: contiguous's imbalance); `comm alone` = the
same call under ring_attention.comm_only() (same transfers, no block compute); hidden = 1 -
exposed / comm alone. On an emulated link rank 0 counts the bytes on the namespace's lo
(`wire`, both directions share one tbf queue); floor = wire / rate.

Training loop (each 2-rank launch, after the lengths): one layer's attention called
LOOP_CALLS times in a row at LOOP_SEQ tokens (the same shapes every call, as in training), the
arguments' agreement reused (pyfast.parallel.cp_agree) against agreed anew on every call (what
every call cost before), in alternating blocks: per-call time of each and their ratio.

Memory, from a launch of its own (loopback, glibc's mmap threshold pinned to 64 KB so freed
tensors leave the RSS, as in zero.py; never timed): peak = the RSS high-water mark of one fwd +
bwd (clear_refs reset just before) above the RSS before the inputs were made: q, k, v, dout and
all fwd + bwd allocate; max over ranks, against one process's (1 thread).

Cost: one thread's fwd + bwd takes ~0.45 s at 4K tokens, ~25 s at 32K (x4 a doubling; ~75
GFLOP/s a thread, 2-core EPYC VM). A repeat runs the one-process pair (1.5x that) and per link
three 2-rank providers (~1.75x): the default run (3 repeats at every length, 2 links, memory)
takes 12-14 minutes on a quiet machine (estimated); --lengths and --repeats shorten it.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pyfast
from pyfast import perf
from pyfast._io import atomic_write_text
from pyfast import netns
from pyfast.benchmarks.zero import _reset_peak, _rss
from pyfast.parallel import cp_agree, ring_attention as ring
from pyfast.parallel.context import context_parallel_attention, shard_sequence

ONE = {"1 process x 1 thread": 1, "1 process x 2 threads": 2}
ONE1, ONE2 = ONE
METHODS = {"ring zigzag": ("ring", "zigzag"), "ring contiguous": ("ring", "contiguous"),
           "ulysses zigzag": ("ulysses", "zigzag"), "ulysses contiguous": ("ulysses", "contiguous")}
# Ulysses attends over the whole sequence in natural order whatever the layout: its contiguous
# row would time the same work again, so it runs only when asked for (--providers)
PROVIDERS = ["ring zigzag", "ring contiguous", "ulysses zigzag"]
LENGTHS = (4096, 8192, 16384, 32768)
LINKS = ("loopback", "1gbit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}
WORLD, SEED = 2, 1234
# The training loop's case: one layer's attention called again and again with the same shapes.
# Short (a gpt-tiny-sized layer, 128 tokens a rank) so that the agreement's fixed cost shows.
LOOP_SEQ, LOOP_CALLS = 256, 20


# -- inside a rank process -------------------------------------------------------------------
def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, obj)
    return each


def _full(job, seq: int) -> list[torch.Tensor]:
    """q, k, v, dout of the whole sequence: the same on every rank."""
    g = torch.Generator().manual_seed(SEED)
    shape = (job["batch"], job["heads"], seq, job["head_dim"])
    return [torch.randn(shape, generator=g).to(DTYPES[job["dtype"]]) for _ in range(4)]


def _inputs(full, layout: str | None) -> list[torch.Tensor]:
    """q, k, v (leaves that want gradients), dout: the whole sequence or this rank's shards."""
    ts = full if layout is None else [shard_sequence(t, None, 2, layout) for t in full]
    return [t.requires_grad_(True) for t in ts[:3]] + [ts[3]]


def _layout(provider: str) -> str | None:
    return METHODS[provider][1] if provider in METHODS else None


def _step(provider: str, q, k, v, dout) -> torch.Tensor:
    for t in (q, k, v):
        t.grad = None
    if provider in ONE:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        method, layout = METHODS[provider]
        out = context_parallel_attention(q, k, v, causal=True, method=method, layout=layout)
    out.backward(dout)
    return out


def _gate(job) -> dict:
    """Each provider's worst relative error (output, dq, dk, dv) against dense SDPA at the
    smallest length; raises on every rank alike if one is over TOL."""
    full = _full(job, min(job["lengths"]))
    ref = _inputs([t.clone() for t in full], None)
    want = [_step(ONE1, *ref).detach(), *(t.grad for t in ref[:3])]
    errs = {}
    for p in job["providers"]:
        x = _inputs(full, _layout(p))
        got = [_step(p, *x).detach(), *(t.grad for t in x[:3])]
        errs[p] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                      for a, b in zip(got, (shard_sequence(w, None, 2, _layout(p)) for w in want)))
    worst = {p: max(e[p] for e in _gather(errs)) for p in errs}
    bad = {p: f"{e:.2e}" for p, e in worst.items() if not e <= TOL[job["dtype"]]}
    if bad:
        raise RuntimeError(f"correctness gate at {min(job['lengths'])} tokens: relative error "
                           f"against dense SDPA over {TOL[job['dtype']]:.0e}: {bad}")
    return worst


def _timing(job, rank: int) -> dict:
    provs = job["providers"]
    rings = [p for p in provs if METHODS.get(p, ("",))[0] == "ring"]
    count = bool(os.environ.get("PYFAST_NETNS")) and rank == 0
    gate = _gate(job) if dist.is_initialized() else None  # also the 2 ranks' warm-up
    if gate is None:  # one process: first-call initialisation (0.2 s) is not the problem's
        _step(provs[0], *_inputs(_full(job, min(job["lengths"])), None))
    rows = []
    for seq in job["lengths"]:
        full = _full(job, seq)
        # in providers' order on every rank (a set's order is per process: shard_sequence agrees)
        inputs = {lay: _inputs(full, lay) for lay in dict.fromkeys(map(_layout, provs))}
        del full
        t, waits, alone, sent = ({p: [] for p in provs} for _ in range(4))
        for _ in range(job["repeats"]):
            for p in provs:
                b0 = netns.lo_tx_bytes() if count else 0  # before the barrier: no race
                _barrier()
                dev = inputs[_layout(p)][0].device
                t0 = perf.clock(dev)
                _step(p, *inputs[_layout(p)])
                t[p].append(perf.clock(dev) - t0)
                waits[p].append(ring.last_wait["forward"] + ring.last_wait["backward"])
                _barrier()  # every rank's transfers are done: the bytes are all on the link
                if count:
                    sent[p].append(netns.lo_tx_bytes() - b0)
            for p in rings:
                _barrier()
                dev = inputs[_layout(p)][0].device
                t0 = perf.clock(dev)
                with ring.comm_only():
                    _step(p, *inputs[_layout(p)])
                alone[p].append(perf.clock(dev) - t0)
        each = _gather({"t": t, "waits": waits, "alone": alone})
        slowest = lambda key, p: [max(x) for x in zip(*(e[key][p] for e in each))]  # noqa: E731
        for p in provs:
            row = {"seq": seq, "provider": p, **perf.summary(slowest("t", p))}
            if p in rings:
                row["exposed_s"] = statistics.median(slowest("waits", p))
                row["comm_alone_s"] = statistics.median(slowest("alone", p))
            if count:
                row["wire_bytes"] = statistics.median(sent[p])
            rows.append(row)
        del inputs
        gc.collect()
    loop = _loop(job) if dist.is_initialized() else []
    return {"gate": gate, "rows": rows, "load": os.getloadavg()[0], "loop": loop}


def _loop(job) -> list[dict]:
    """Per provider: fwd+bwd of LOOP_SEQ tokens called `calls` times in a row, the arguments'
    agreement reused (cached: every call after the first) against agreed anew on every call
    (uncached: cp_agree.forget before each, so each runs the full check and waits for the
    all-gather, as every call did before the cache), in alternating blocks; per call: the
    slowest rank's block time / calls, median over the blocks."""
    x = _inputs(_full(job, job["loop_seq"]), "zigzag")
    provs = [p for p in job["providers"] if _layout(p) == "zigzag"]
    t = {(p, mode): [] for p in provs for mode in ("cached", "uncached")}
    for p in provs:
        _step(p, *x)  # warm-up, and the agreement the cached blocks reuse
    for _ in range(max(3, job["repeats"])):
        for p in provs:
            for mode in ("cached", "uncached"):
                _barrier()
                t0 = time.perf_counter()
                for _ in range(job["loop_calls"]):
                    if mode == "uncached":
                        cp_agree.forget(None)
                    _step(p, *x)
                t[(p, mode)].append((time.perf_counter() - t0) / job["loop_calls"])
    each = _gather({f"{p}|{m}": v for (p, m), v in t.items()})
    per = {k: statistics.median([max(x) for x in zip(*(e[k] for e in each))]) for k in each[0]}
    return [{"provider": p, "seq": job["loop_seq"], "calls": job["loop_calls"],
             "cached_s": per[f"{p}|cached"], "uncached_s": per[f"{p}|uncached"],
             "ratio": per[f"{p}|uncached"] / per[f"{p}|cached"],
             "saved_s": per[f"{p}|uncached"] - per[f"{p}|cached"]} for p in provs]


def _memory(job, rank: int) -> list[dict]:
    """Peak RSS of one fwd+bwd per (length, provider), one alive at a time; one process on rank
    0 alone (rank 1 waits at the next barrier). `left`: the RSS left over after it (~0)."""
    mine = {}
    for p in [ONE1, *job["providers"]]:  # warm-up: first-call initialisation is not a peak
        if p not in ONE or rank == 0:
            _step(p, *_inputs(_full(job, min(job["lengths"])), _layout(p)))
    for seq in job["lengths"]:
        for p in [ONE1, *job["providers"]]:
            gc.collect()
            _barrier()
            if p in ONE and rank != 0:
                continue
            base = _rss()[0]
            x = _inputs(_full(job, seq), _layout(p))
            if p not in ONE:
                _barrier()
            _reset_peak()
            out = _step(p, *x)
            peak = _rss()[1] - base
            del out, x
            gc.collect()
            mine[f"{seq} {p}"] = (peak, _rss()[0] - base)
    each = _gather(mine)
    return [{"seq": int(key.split(" ", 1)[0]), "provider": key.split(" ", 1)[1],
             "peak": max(e[key][0] for e in each if key in e),
             "left": max(e[key][1] for e in each if key in e)} for key in mine]


def _worker() -> None:
    job = json.loads(os.environ["PYFAST_CP"])
    torch.set_num_threads(job["threads"])
    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    rank = dist.get_rank() if world > 1 else 0
    got = (_memory if job["phase"] == "memory" else _timing)(job, rank)
    if rank == 0:
        atomic_write_text(job["out"], json.dumps(got))
    if world > 1:
        dist.barrier()
        netns.finish_group()


# -- the driver (parent process) ---------------------------------------------------------------
def _launch(phase: str, link: str, world: int, job: dict, env: dict | None = None):
    with tempfile.TemporaryDirectory() as d:
        job = {**job, "phase": phase, "out": os.path.join(d, "r.json")}
        netns.run_ranks(["-c", "from pyfast.benchmarks.cp import _worker; _worker()"], world,
                        link, job["timeout"], env={"PYFAST_CP": json.dumps(job), **(env or {})},
                        fork=phase != "memory")  # memory: fresh processes (netns.ranks)
        with open(job["out"]) as f:
            return json.load(f)


def input_bytes(job: dict, seq: int, world: int) -> int:
    """q, k, v and dout of `seq` tokens on one of `world` ranks."""
    per = job["batch"] * job["heads"] * seq * job["head_dim"] * DTYPES[job["dtype"]].itemsize
    return 4 * per // world


def run(lengths=LENGTHS, links=LINKS, repeats: int = 3, heads: int = 4, head_dim: int = 64,
        batch: int = 1, dtype: str = "fp32", providers=PROVIDERS, timeout: float = 3600,
        log=print, loop_seq: int = LOOP_SEQ, loop_calls: int = LOOP_CALLS) -> dict:
    lengths = sorted(lengths)
    for link in links:
        netns.rate_bps(link)  # a bad link string fails before anything runs
    if bad := [s for s in lengths if s % (2 * WORLD)]:
        raise ValueError(f"lengths {bad}: zigzag on {WORLD} ranks needs multiples of {2 * WORLD}")
    if bad := [p for p in providers if p not in METHODS]:
        raise ValueError(f"unknown providers {bad}; known: {', '.join(METHODS)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if loop_seq % (2 * WORLD) or loop_calls < 1:
        raise ValueError(f"the training loop's row needs a length divisible by {2 * WORLD} and "
                         f">= 1 call, got {loop_seq} tokens, {loop_calls} calls")
    if any(METHODS[p][0] == "ulysses" for p in providers) and heads % WORLD:
        raise ValueError(f"ulysses needs heads divisible by {WORLD}, got {heads}")
    job = {"lengths": lengths, "repeats": repeats, "heads": heads, "head_dim": head_dim,
           "batch": batch, "dtype": dtype, "providers": list(providers), "timeout": timeout,
           "threads": 1, "loop_seq": loop_seq, "loop_calls": loop_calls}
    load0 = os.getloadavg()[0]
    memory = _launch("memory", "loopback", WORLD, job, {"MALLOC_MMAP_THRESHOLD_": "65536"})
    log("done: memory")
    rows, gates, loads, loops = [], {}, {}, []
    for name, threads in ONE.items():
        got = _launch("timing", "loopback", 1, {**job, "providers": [name], "threads": threads})
        rows += [{**r, "link": "-"} for r in got["rows"]]
        log(f"done: {name}")
    for link in links:
        try:
            got = _launch("timing", link, WORLD, job)
        except netns.LinkUnavailable as e:
            rows.append({"link": link, "skipped": str(e)})
            log(f"skipped {link}: {e}")
            continue
        gates[link], loads[link], bps = got["gate"], got["load"], netns.rate_bps(link)
        for r in got["rows"]:
            r["link"] = link
            if "wire_bytes" in r and bps:
                r["floor_s"] = r["wire_bytes"] * 8 / bps
        rows += got["rows"]
        loops += [{**r, "link": link} for r in got["loop"]]
        log(f"done: {link}")
    _derive(rows, memory, job)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' setting, for the machine line
    machine = perf.machine()
    torch.set_num_threads(threads)
    result = {"machine": machine,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "pyfast": pyfast.__version__, "world": WORLD, "repeats": repeats,
              "problem": f"B={batch} H={heads} D={head_dim} {dtype} causal",
              "lengths": lengths, "links": {k: netns.rate_bps(k) for k in links},
              "providers": list(providers), "gate": gates, "tol": TOL[dtype],
              "load": [load0, *loads.values(), os.getloadavg()[0]], "memory": memory,
              "rows": rows, "loop": loops}
    result["targets"] = targets(result)
    return result


def _derive(rows: list[dict], memory: list[dict], job: dict) -> None:
    """Ratios to one process, zigzag vs contiguous, hidden fraction, memory per row."""
    t = {(r["link"], r["seq"], r["provider"]): r["median_s"] for r in rows if "median_s" in r}
    mem = {(m["seq"], m["provider"]): m for m in memory}
    for r in rows:
        if "median_s" not in r:
            continue
        seq, p, link = r["seq"], r["provider"], r["link"]
        for key, ref in (("vs_1_thread", ONE1), ("vs_2_threads", ONE2)):
            r[key] = t[("-", seq, ref)] / r["median_s"] if ("-", seq, ref) in t else None
        if p.endswith("zigzag"):
            other = t.get((link, seq, p.replace("zigzag", "contiguous")))
            r["zigzag_speedup"] = other / r["median_s"] if other else None
        if r.get("comm_alone_s"):
            r["hidden"] = 1 - r["exposed_s"] / r["comm_alone_s"]
        r["input_bytes"] = input_bytes(job, seq, 1 if p in ONE else WORLD)
        if (seq, p) in mem and p != ONE2:
            r["peak_bytes"] = mem[(seq, p)]["peak"]
            one = mem.get((seq, ONE1))
            r["peak_vs_one"] = r["peak_bytes"] / one["peak"] if one and one["peak"] else None


def targets(result: dict) -> list[dict]:
    """The issue's targets at the longest length, measured, and if missed by how much; a target
    whose rows were not measured is left out."""
    by = {(r["link"], r["seq"], r["provider"]): r for r in result["rows"] if "median_s" in r}
    n, out = max(result["lengths"]), []

    def add(what, r, key, goal, fmt, scale=1, at_least=True, tokens=n):
        if not r or r.get(key) is None:
            return
        v = r[key] * scale
        met, miss = (v >= goal, 1 - v / goal) if at_least else (v <= goal, v / goal - 1)
        out.append({"target": f"{what} ({tokens} tokens)", "measured": fmt % v, "met": bool(met),
                    "goal": f"{'>=' if at_least else '<='} {fmt % goal}",
                    "missed_by": None if met else f"{100 * miss:.0f}%"})
    add("loopback: ring zigzag vs 1 process x 1 thread", by.get(("loopback", n, "ring zigzag")),
        "vs_1_thread", 1.7, "%.2fx")
    for link in result["links"]:
        add(f"{link}: ring zigzag vs contiguous", by.get((link, n, "ring zigzag")),
            "zigzag_speedup", 1.3, "%.2fx")
    for p in result["providers"]:
        add(f"{p}: peak memory per rank / 1 process's", next(
            (r for r in by.values() if (r["seq"], r["provider"]) == (n, p)), None),
            "peak_vs_one", 0.6, "%.2f", at_least=False)
    for link, bps in result["links"].items():
        if bps:
            add(f"{link}: ring zigzag communication hidden", by.get((link, n, "ring zigzag")),
                "hidden", 80, "%.0f%%", 100)
    for r in result.get("loop", []):  # issue 25: the loop gains the agreement's cost back
        add(f"{r['link']}: {r['provider']} training loop, agreement cached vs per call", r,
            "ratio", 1.0, "%.2fx", tokens=r["seq"])
    return out


COLUMNS = {"median s": ("median_s", "%.3f", 1), "vs 1 thr": ("vs_1_thread", "%.2fx", 1),
           "vs 2 thr": ("vs_2_threads", "%.2fx", 1), "zz vs contig": ("zigzag_speedup", "%.2fx", 1),
           "inputs MB": ("input_bytes", "%.0f", 1e-6), "peak MB": ("peak_bytes", "%.0f", 1e-6),
           "peak vs 1 proc": ("peak_vs_one", "%.2f", 1), "exposed s": ("exposed_s", "%.3f", 1),
           "comm alone s": ("comm_alone_s", "%.3f", 1), "hidden": ("hidden", "%.0f%%", 100),
           "wire MB": ("wire_bytes", "%.1f", 1e-6), "floor s": ("floor_s", "%.3f", 1)}


def table(result: dict):
    t = perf.rich_table(
        f"Causal attention fwd+bwd, {result['problem']}; {result['world']} ranks x 1 thread vs "
        f"1 process; median of {result['repeats']}, slowest rank, round robin", result,
        ("tokens", "link", "provider", *COLUMNS), left=("link", "provider"), no_wrap=True)
    order = ["-", *result["links"]]
    rows = sorted((r for r in result["rows"] if "median_s" in r),
                  key=lambda r: (r["seq"], order.index(r["link"])))
    for i, r in enumerate(rows):
        cells = ["" if r.get(k) is None else fmt % (r[k] * x) for k, fmt, x in COLUMNS.values()]
        t.add_row(str(r["seq"]), r["link"], r["provider"], *cells,
                  end_section=i == len(rows) - 1 or rows[i + 1]["seq"] != r["seq"])
    gates = "; ".join(f"{link}: " + ", ".join(f"{p} {e:.1e}" for p, e in g.items())
                      for link, g in result["gate"].items())
    t.caption_justify = "left"
    t.caption = "\n".join(
        [f"{r['link']}: not run, {r['skipped']}" for r in result["rows"] if "skipped" in r]
        + [f"{'met   ' if g['met'] else 'MISSED'} {g['target']}: {g['measured']} (target "
           f"{g['goal']}{'' if g['met'] else ', missed by ' + g['missed_by']})"
           for g in result["targets"]]
        + [f"training loop, {r['link']}, {r['provider']}: {r['calls']} calls of {r['seq']} "
           f"tokens fwd+bwd, agreement cached {1e3 * r['cached_s']:.2f} ms a call, agreed every "
           f"call {1e3 * r['uncached_s']:.2f} ms: {r['ratio']:.2f}x, "
           f"{1e3 * r['saved_s']:.2f} ms saved a call" for r in result.get("loop", [])]
        + [f"correctness gate at {min(result['lengths'])} tokens, max |err| / max |dense SDPA| "
           f"of out, dq, dk, dv (tolerance {result['tol']:.0e}): {gates}",
           "peak: RSS high-water mark of one fwd+bwd above the RSS before the inputs (own "
           "launch; 1 process at 1 thread), max over ranks; inputs: q, k, v, dout (a rank's). "
           "exposed: the ring's fwd+bwd waiting on transfers; comm alone: the same call without "
           "block compute; hidden = 1 - exposed / comm alone; wire: bytes on the namespace's lo "
           "a call, floor = wire / rate. load: " + " / ".join(f"{v:.1f}" for v in result["load"])
           + " (start, after each link, end)"]
        + ([f"note: {result['note']}"] if result.get("note") else []))
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench cp", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="tokens, comma-separated")
    p.add_argument("--links", default=",".join(LINKS), help="loopback and/or tc rates (1gbit)")
    for flag, default in (("--repeats", 3), ("--heads", 4), ("--head-dim", 64), ("--batch", 1)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--providers", default=",".join(PROVIDERS), help=f"of: {', '.join(METHODS)}")
    p.add_argument("--loop-seq", type=int, default=LOOP_SEQ, help="the training loop row's tokens")
    p.add_argument("--loop-calls", type=int, default=LOOP_CALLS, help="its calls a block")
    p.add_argument("--note", default="", help="recorded with the results (e.g. 'under load')")
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    try:
        res = run([int(v) for v in a.lengths.split(",")], a.links.split(","), a.repeats, a.heads,
                  a.head_dim, a.batch, a.dtype, a.providers.split(","),
                  loop_seq=a.loop_seq, loop_calls=a.loop_calls)
    except ValueError as e:
        p.error(str(e))
    res["note"] = a.note
    return perf.finish(res, table, a.out, width=200)


if __name__ == "__main__":
    raise SystemExit(main())
