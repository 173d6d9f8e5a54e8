"""The main training job's throughput (`pyfast bench train`): tokens/s of pyfast.train.job.Job's
real step (gpt-small, seq 256, global batch 8, fp32, AdamW, global-norm clipping) per mesh
against one process (1 and 2 threads) and against the torch-native job that does the same work
(same model, same batches, AdamW with the same groups, clip_grad_norm_ to 1.0), side by side in
one run, on plain loopback and on an emulated link (2 ranks x 1 thread).

  1proc x 1thr / 2thr    Job with dp=tp=pp=1 in a 1-rank group: a child process of rank 0,
                         stepped in turn with the others (loopback only)
  pyfast dp2 [+int8]     Job dp=2 (DataParallel, compress none / int8)
  pyfast tp2, pp2        Job tp=2 (parallelize; a byte vocabulary stays whole); pp=2 (1f1b, m=4)
  torch DDP [+bf16 hook] DistributedDataParallel, plain / default_hooks.bf16_compress_hook
  torch DDP+fused AdamW  (only if --configs names it) DDP with torch's fused CPU AdamW: the Job
                         steps pyfast's fused one on CPU (pyfast.optim.job_adamw), the torch
                         rows torch's default, its per-tensor loop there
  torch DTensor TP       parallelize_module: Colwise qkv, fc / Rowwise proj of every block;
                         embedding and head replicated (the full-vocabulary loss on every rank)
  torch pipelining       PipelineStage + Schedule1F1B, 4 micro-batches, pyfast's cut (balance
                         by parameters), global-norm clip by an all-reduce of squared norms

Step time: median over the timed steps of the slowest rank's step (a barrier before each);
CPU ms: process CPU seconds a rank spends in a step (every thread: the engines' and gloo's too),
the median over steps of the ranks' mean (`pyfast bench dp --cpu-split` splits DataParallel's);
the providers of a launch take their steps in turn (round robin). Every provider's first-step
loss must equal the dense model's on the same global batch within 1e-4 (and, uncompressed, its
gradient norm within 0.1%) before it is timed: a wrong sharding is reported, never timed.
"""
from __future__ import annotations

import argparse
import contextlib
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
from torch import nn

import pyfast
from pyfast import models, perf
from pyfast._io import atomic_write_text
from pyfast import netns
from pyfast.data import Batches, load_corpus

DEVICE = torch.device("cpu")  # every provider's (gloo ranks); steps are timed with perf.clock
ONE = {"1proc x 1thr": 1, "1proc x 2thr": 2}  # name -> threads of the single process
PYFAST = {"pyfast dp2": {"dp": 2}, "pyfast dp2+int8": {"dp": 2, "compress": "int8"},
          "pyfast tp2": {"tp": 2}, "pyfast pp2": {"pp": 2, "schedule": "1f1b"},
          # what a user who asks for "auto" on a fast link gets (issue 25: >= 1.0x DDP)
          "pyfast dp2+auto": {"dp": 2, "compress": "auto"}}
PEER = {"pyfast dp2": "torch DDP", "pyfast dp2+int8": "torch DDP+bf16 hook",
        "pyfast tp2": "torch DTensor TP", "pyfast pp2": "torch pipelining",
        "pyfast dp2+auto": "torch DDP"}
FUSED = "+fused AdamW"  # a peer with torch's fused CPU AdamW: optional rows (--configs)
# each pyfast mesh next to its peer: the two see the same load on the shared machine
CONFIGS = list(dict.fromkeys([*ONE, *(c for p in PYFAST for c in (p, PEER[p]))]))
DIVIDES = {"dp": 2, "DDP": 2, "pp2": 4, "pipelining": 4}  # global batch must divide by this
TOL = 1e-4


def _fits(name: str, batch: int) -> str | None:
    for key, d in DIVIDES.items():
        if key in name and batch % d:
            return f"global batch {batch} does not divide into {d} (ranks or micro-batches)"
    return None


def _adamw(params, fused: bool = False):
    """torch's AdamW as a torch user writes it (on CPU tensors its per-tensor loop, the default;
    the Job steps pyfast.optim.AdamW's fused C++ pass there), or with fused=True (torch's own
    fused CPU kernel: the "+fused AdamW" rows, which take the optimizer out of the comparison)."""
    decay, rest = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95),
                             **({"fused": True} if fused else {}))


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())


def _job(name, j, rank, world, corpus):
    """Job's own step; its loss is already the global one (rank 0 contributes it)."""
    from pyfast.train.config import TrainConfig
    from pyfast.train.job import Job
    mesh = PYFAST.get(name, {})
    cfg = TrainConfig(model=j["model"], batch=j["batch"], seq=j["seq"],
                      steps=j["warmup"] + j["steps"], **mesh)
    job = Job(cfg, DEVICE)

    def step(i):  # (this rank's share of the loss, of the gradient norm), Job's record
        rec = job.train_step(i)
        return (rec["loss"] if rank == 0 else 0.0), rec["grad_norm"] / world, rec
    return step, job.close


def _solo(conn, j, names) -> None:
    """The one-process rows, in a child of rank 0 with a 1-rank group of its own: Job needs a
    default group of exactly dp*tp*pp ranks, and a separate launch would time them at another
    moment (the 1proc/dp2 ratio moved 0.85 -> 0.73 between two launches of the same run)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    corpus = load_corpus()
    jobs = {n: _job(n, j, 0, 1, corpus) for n in names}
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        torch.set_num_threads(ONE[msg[0]])
        conn.send(jobs[msg[0]][0](msg[1]))
    for _, close in jobs.values():
        close()
    netns.finish_group()


def _solo_steps(j, names, rank):
    """Step functions for the one-process rows: rank 0 runs them in _solo's process (while rank
    1 waits in the next barrier, so the child has both cores); rank 1's steps do nothing."""
    if rank != 0:
        return {n: (lambda i: (0.0, 0.0, {}), lambda: None) for n in names}, None
    import multiprocessing
    here, there = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_solo, args=(there, j, names))
    child.start()
    if here.recv() != "ready":
        raise RuntimeError("the one-process child did not start")

    def step(name):
        return lambda i: (here.send((name, i)), here.recv())[1]

    def close():
        here.send(None)
        child.join(60)
    return {n: (step(n), lambda: None) for n in names}, close


def _torch(name, j, rank, world, corpus):
    """The torch-native job: same model (seed 0), batches, AdamW and clipping as Job."""
    torch.manual_seed(0)
    model = models.build(j["model"], corpus.vocab_size, j["seq"])
    dp = "DDP" in name
    batches = Batches(corpus.train, j["batch"], j["seq"], 0, rank if dp else 0, world if dp else 1)
    clip, share = torch.nn.utils.clip_grad_norm_, 1.0 / world if dp else float(rank == 0)
    ctx = contextlib.nullcontext
    if dp:
        net = nn.parallel.DistributedDataParallel(model)
        if "bf16" in name:
            net.register_comm_hook(None, _bf16_hook)
        params = list(model.parameters())
    elif name == "torch DTensor TP":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import implicit_replication
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        plan = {}
        for i in range(1, len(model) - 1):  # qkv rows are per head: a column split = whole heads
            plan.update({f"{i}.attn.qkv": ColwiseParallel(), f"{i}.mlp.fc": ColwiseParallel(),
                         f"{i}.attn.proj": RowwiseParallel(), f"{i}.mlp.proj": RowwiseParallel()})
        net = parallelize_module(model, init_device_mesh(DEVICE.type, (world,)), plan)
        params = list(model.parameters())
        # replicated (plain) and sharded (DTensor) parameters in one foreach list: torch's
        # _foreach_norm and AdamW refuse the mix unless plain tensors count as replicated
        ctx = implicit_replication
    else:  # pipelining: pyfast Pipeline's cut (equal parameter counts)
        from torch.distributed import pipelining as tpp

        from pyfast.parallel.schedules import partition
        counts = partition([sum(p.numel() for p in m.parameters()) for m in model], world)
        lo = sum(counts[:rank])
        net = nn.Sequential(*(model[i] for i in range(lo, lo + counts[rank])))
        sched = tpp.Schedule1F1B(tpp.PipelineStage(net, rank, world, DEVICE),
                                 n_microbatches=2 * world, loss_fn=_ce)
        params, share = list(net.parameters()), float(rank == world - 1)
        clip = _global_clip
    opt = _adamw(params, fused="fused AdamW" in name)

    def step(i):
        opt.zero_grad(set_to_none=True)
        x, y = batches.next()
        if name == "torch pipelining":
            losses = []
            sched.step(x) if rank == 0 else sched.step(target=y, losses=losses)
            loss = torch.stack(losses).mean() if losses else torch.zeros(())
        else:
            loss = _ce(net(x), y)
            loss.backward()
        with ctx():
            gnorm = clip(params, 1.0)
            opt.step()
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # DTensor TP
        return float(loss.detach()) * share, float(gnorm) / world, {}
    return step, lambda: None


def _bf16_hook(state, bucket):
    """torch's bf16_compress_hook unchanged. DDP refuses it by name unless CUDA+NCCL or XPU,
    but the hook is only a cast, a divide and an all-reduce, which gloo runs in bf16."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as dh
    return dh.bf16_compress_hook(state, bucket)


def _global_clip(params, max_norm: float):
    """clip_grad_norm_ over the stages together: one all-reduce of the squared norm, as Job."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
    dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def _reference(j, corpus):
    """The dense model's loss and gradient norm on the first global batch (what step 1 sees)."""
    torch.manual_seed(0)
    model = models.build(j["model"], corpus.vocab_size, j["seq"])
    x, y = Batches(corpus.train, j["batch"], j["seq"], 0).next()
    loss = _ce(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return float(loss.detach()), float(norm)


def _first_step(name, share, norm_share, ref_loss, ref_norm) -> dict:
    """The global first-step loss and gradient norm (an all-reduce of the ranks' shares,
    outside the timing, so every rank decides the same) against the dense model's; the norm
    catches a wrong gradient scale (compressed rows differ from it by design)."""
    v = torch.tensor([share, norm_share], dtype=torch.float64)
    dist.all_reduce(v)
    loss, norm = float(v[0]), float(v[1])
    out = {"loss1": loss, "grad_norm1": norm}
    lossy = "int8" in name or "bf16" in name
    if abs(loss - ref_loss) > TOL or (not lossy and abs(norm - ref_norm) > 1e-3 * ref_norm):
        out["error"] = (f"first step: loss {loss:.6f}, grad norm {norm:.5f}; dense "
                        f"{ref_loss:.6f}, {ref_norm:.5f}: not timed")
    return out


def _worker() -> None:
    from pyfast.train.telemetry import bytes_written
    j = json.loads(os.environ["PYFAST_TRAIN"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=j["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus()
    ref_loss, ref_norm = _reference(j, corpus)
    live, stop = _solo_steps(j, [n for n in j["configs"] if n in ONE], rank)
    rows, log = {}, {}
    for name in j["configs"]:
        if name not in ONE:
            live[name] = (_torch if name.startswith("torch") else _job)(name, j, rank, world,
                                                                       corpus)
        rows[name] = {"config": name, "ref_loss": ref_loss, "ref_grad_norm": ref_norm}
        log[name] = {"times": [], "sent": [], "recs": [], "cpu": []}
    # Round robin, one step of each provider in turn, not one provider after the other: run
    # in sequence, whichever of a pair ran first was up to 12% slower (global batch 2, loopback:
    # DDP first 444 vs dp2 438 ms, dp2 first 426 vs DDP 374), and the first training job in
    # a process page-faulted ~12,000 times a step where later ones did not (glibc handing freed
    # heap back to the kernel). In turn, every provider sees the same machine.
    for i in range(j["warmup"] + j["steps"]):
        for name, (step, close) in [(n, live[n]) for n in j["configs"] if n in live]:
            dist.barrier()
            w0, t0, c0 = bytes_written(), perf.clock(DEVICE), time.process_time()
            share, gnorm, rec = step(i + 1)
            if i >= j["warmup"]:
                log[name]["times"].append(perf.clock(DEVICE) - t0)
                log[name]["cpu"].append(time.process_time() - c0)
                log[name]["sent"].append(bytes_written() - w0)
                log[name]["recs"].append(rec)
            if i == 0:
                rows[name].update(_first_step(name, share, gnorm, ref_loss, ref_norm))
                if "error" in rows[name]:  # a wrong sharding is not timed
                    close()
                    del live[name]
    for _, close in live.values():
        close()
    if stop is not None:
        stop()
    live, step, close = {}, None, None  # the Jobs go before the process group does
    gc.collect()
    dist.barrier()
    each = [None] * world
    dist.all_gather_object(each, log)
    for name, row in rows.items():
        if "error" in row:
            continue
        mine = [e[name] for e in each]
        slow = [max(range(world), key=lambda r: mine[r]["times"][i]) for i in range(j["steps"])]
        per_step = [mine[r]["times"][i] for i, r in enumerate(slow)]
        row.update(**perf.summary(per_step), times=per_step,
                   wire_bytes=statistics.median(map(sum, zip(*(e["sent"] for e in mine)))))
        if name not in ONE:  # process CPU seconds a rank-step (every thread), the ranks' mean
            row["cpu_ms"] = 1e3 * statistics.median(map(statistics.mean,
                                                        zip(*(e["cpu"] for e in mine))))
        if mine[0]["recs"][0]:  # Job's own breakdown, from the slowest rank of each step
            for k in ("compute_ms", "exposed_comm_ms", "bytes_sent"):
                row[k] = statistics.median(mine[r]["recs"][i][k] for i, r in enumerate(slow))
    if rank == 0:
        atomic_write_text(j["out"], json.dumps(list(rows.values())))
    dist.barrier()
    netns.finish_group()


def _launch(world, link, job, timeout) -> list[dict]:
    if not job["configs"]:
        return []
    with tempfile.TemporaryDirectory() as d:
        job = {**job, "out": os.path.join(d, "r.json")}
        netns.run_ranks(["-c", "from pyfast.benchmarks.train import _worker; _worker()"],
                        world, link, timeout, env={"PYFAST_TRAIN": json.dumps(job)})
        with open(job["out"]) as f:
            return json.load(f)


def targets(rows: list[dict]) -> list[dict]:
    """The throughput targets, each with its ratio (None: a row is missing) and met/missed."""
    tps = {(r["link"], r["config"]): r["tokens_s"] for r in rows if "tokens_s" in r}
    ones = ("loopback", "1proc x 1thr") in tps
    out = []

    def add(what, a, b, need, scale=1.0):
        ratio = tps[a] / (scale * tps[b]) if a in tps and b in tps else None
        out.append({"target": what, "ratio": ratio, "need": need,
                    "met": None if ratio is None else ratio >= need})
    if ones:
        add("(1) dp2 >= 0.8 x 2 x 1proc x 1thr (loopback)", ("loopback", "pyfast dp2"),
            ("loopback", "1proc x 1thr"), 0.8, 2.0)
    add("(2) dp2+int8 >= 1.5 x DDP+bf16 hook (1gbit)", ("1gbit", "pyfast dp2+int8"),
        ("1gbit", "torch DDP+bf16 hook"), 1.5)
    for link in sorted({r["link"] for r in rows}):
        for p, t in PEER.items():  # (1) also asks dp2 >= DDP on loopback: the same ratio
            n = "(1,3)" if (link, p) == ("loopback", "pyfast dp2") else "(3)"
            add(f"{n} {p} >= {t} ({link})", (link, p), (link, t), 1)
            # the same with torch's fused AdamW in the peer: what is left is the parallel part
            add(f"{n} {p} >= {t}{FUSED} ({link})", (link, p), (link, t + FUSED), 1)
    return [t for t in out if t["ratio"] is not None]


def run(links=("loopback", "1gbit"), configs=CONFIGS, batch: int = 8, steps: int = 6,
        warmup: int = 2, model: str = "gpt-small", seq: int = 256, timeout: float = 1800) -> dict:
    job = {"model": model, "seq": seq, "batch": batch, "steps": steps, "warmup": warmup,
           "timeout": timeout}
    load = os.getloadavg()[0]  # others may share the machine: say how busy it was
    rows = []
    for link in links:
        mine = [c for c in configs if (c not in ONE or link == "loopback") and not _fits(c, batch)]
        skipped = [(c, _fits(c, batch)) for c in configs if _fits(c, batch)]
        try:
            got = _launch(2, link, {**job, "configs": mine}, timeout)
        except netns.LinkUnavailable as e:
            rows.append({"link": link, "skipped": str(e)})
            continue
        got += [{"config": c, "error": why} for c, why in skipped]
        for r in got:
            r["link"] = link
            if "median_s" in r:
                r["tokens_s"] = batch * seq / r["median_s"]
            rate = netns.rate_bps(link)
            if rate and "wire_bytes" in r:  # both directions share the one qdisc
                r["floor_s"] = 8 * r.get("bytes_sent", r["wire_bytes"]) / rate
        rows += got
    base = {(r["link"], r.get("config")): r.get("tokens_s") for r in rows}
    for r in rows:
        peer = base.get((r["link"], PEER.get(r.get("config"))))
        if peer and "tokens_s" in r:
            r["vs_peer"] = r["tokens_s"] / peer
    date = datetime.datetime.now().isoformat(timespec="seconds")
    return {"machine": perf.machine(), "date": date, "pyfast": pyfast.__version__,
            "model": model, "seq": seq, "batch": batch, "steps": steps, "warmup": warmup,
            "load_avg": [load, os.getloadavg()[0]], "rows": rows, "targets": targets(rows)}


def table(result: dict):
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    load = result["load_avg"]
    t = perf.rich_table(
        f"training step (pyfast.train Job vs torch-native), {result['model']} seq {result['seq']}, "
        f"global batch {result['batch']}, fp32, 1 thread/rank, median of {result['steps']} steps "
        f"after {result['warmup']} (slowest rank); 1-min load avg {load[0]:.2f} before, "
        f"{load[1]:.2f} after", result,
        ("link", "config", "step ms", "tokens/s", "vs peer", "loss@1 - dense", "compute ms",
         "exposed comm ms", "MB sent", "floor ms", "CPU ms"), left=("link", "config"))
    notes = []
    for r in result["rows"]:
        if "skipped" in r or "error" in r:
            notes.append(f"{r['link']} {r.get('config', '')}: {r.get('skipped') or r['error']}")
            t.add_row(r["link"], escape(r.get("config", "-")), "-")
            continue
        f = lambda k, d=0, s=1.0: f"{r[k] * s:.{d}f}" if k in r else ""  # noqa: E731
        mb = r.get("bytes_sent", r["wire_bytes"]) / 1e6
        t.add_row(r["link"], escape(r["config"]), f("median_s", 0, 1e3), f("tokens_s"),
                  f"{r['vs_peer']:.2f}x" if "vs_peer" in r else "",
                  f"{r['loss1'] - r['ref_loss']:+.1e}" if "loss1" in r else "",
                  f("compute_ms"), f("exposed_comm_ms"), f"{mb:.1f}", f("floor_s", 0, 1e3),
                  f("cpu_ms"))
    t.caption = escape("\n".join(notes)) if notes else None
    g = Table(title="targets (tokens/s ratios)")
    for col in ("target", "ratio", "need", "met"):
        g.add_column(col)
    for x in result["targets"]:
        g.add_row(escape(x["target"]), f"{x['ratio']:.3f}", f">= {x['need']}",
                  "met" if x["met"] else "MISSED")
    return Group(t, g)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", default="loopback,1gbit")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", default="", help="write OUT.json and OUT.txt")
    a = p.parse_args(argv)
    known = CONFIGS + [t + FUSED for t in dict.fromkeys(PEER.values()) if "DDP" in t]
    unknown = set(a.configs.split(",")) - set(known)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; known: {', '.join(known)}")
    res = run(a.link.split(","), a.configs.split(","), a.batch, a.steps, a.warmup, a.model, a.seq)
    return perf.finish(res, table, a.out, width=170)


if __name__ == "__main__":
    raise SystemExit(main())
