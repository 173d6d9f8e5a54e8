"""End-to-end data parallel training step (`pyfast bench dp`): pyfast DataParallel (none, int8,
topk + error feedback, auto) against torch DDP (plain, fp16_compress_hook, powerSGD_hook rank
4), same model, same data, same run, 2 ranks with one thread each, on a link.

A pyfast config is `pyfast:SPEC[@ENGINE]`: DataParallel's default engine ("auto": the native
C++ engine where it runs, e.g. int8; the Python thread for topk) unless @native / @python asks;
the @python int8 row shows what the native engine changes.

Also per pyfast config: compute-only step (forward + backward, no reduction) and
communication-only time (every bucket's reduction, back to back, no compute), so the overlap
target (step <= 1.15 x max(compute, comm)) can be checked; and `bound`, the step perfect
overlap would give at this bucketing (_bound): forward cannot overlap this step's reduction and
a layer's gradient cannot be sent before backward made it, so when communication dominates,
step / max(compute, comm) cannot reach 1 (step / bound says how far the engine is from it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import pyfast
from pyfast import perf
from pyfast._io import atomic_write_text
from pyfast import netns

CONFIGS = ["ddp", "ddp+fp16", "ddp+powersgd:4", "pyfast:none", "pyfast:int8",
           "pyfast:int8@python", "pyfast:topk:0.01", "pyfast:auto"]


def build(seed: int = 0):
    import torch
    from torch import nn
    torch.manual_seed(seed)  # ~9.4M parameters, 37.7 MB of fp32 gradients
    return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                         nn.Linear(2048, 1024), nn.GELU(), nn.Linear(1024, 1024))


def _wrap(cfg: str, m, bucket_mb=None):
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as dh
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as ph
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pyfast.parallel.data import DataParallel
    if cfg.startswith("pyfast:"):
        spec, _, engine = cfg.split(":", 1)[1].partition("@")
        return DataParallel(m, spec, engine=engine or "auto",
                            **({"bucket_mb": bucket_mb} if bucket_mb else {}))
    net = DDP(m)
    if cfg == "ddp+fp16":
        net.register_comm_hook(None, dh.fp16_compress_hook)
    elif cfg.startswith("ddp+powersgd"):
        state = ph.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        net.register_comm_hook(state, ph.powerSGD_hook)
    return net


def _bound(compute: float, ready: list[float], alone: list[float]) -> float:
    """The step with perfect overlap at this bucketing: bucket i cannot start before its
    gradients are ready (compute-only run) and the link takes the buckets one at a time, each
    as long as by itself, so the step is at least ready[i] + alone[i] + ... + alone[-1]."""
    return max([compute] + [r + sum(alone[i:]) for i, r in enumerate(ready)])


def _worker() -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    job = json.loads(os.environ["PYFAST_DP"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randn(job["batch"], 1024, generator=g) for _ in range(4)]
    teacher = build(99)
    with torch.no_grad():
        targets = [teacher(x) for x in data]
    rows = []
    for cfg in job["configs"]:
        m = build()
        dev = perf.device_of(m)  # every timing below waits for its work (perf.clock)
        net = _wrap(cfg, m, job.get("bucket_mb"))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        times = []
        for step in range(job["warmup"] + job["steps"]):
            x, y = data[step % 4], targets[step % 4]
            dist.barrier()
            t0 = perf.clock(dev)
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(perf.clock(dev) - t0)
        row = {"config": cfg, "times": times[job["warmup"]:], "loss": float(loss)}
        if cfg.startswith("pyfast:"):
            buckets = net.bucketer.buckets
            comp, ready = [], []  # compute only: the same step with no reduction
            seen: dict = {}
            hooks = [p.register_post_accumulate_grad_hook(
                lambda p: seen.__setitem__(p, perf.clock(p.device))) for p in net.parameters()]
            for step in range(3):
                seen.clear()
                t0 = perf.clock(dev)
                with net.no_sync():
                    nn.functional.mse_loss(net(data[0]), targets[0]).backward()
                comp.append(perf.clock(dev) - t0)
                ready.append([max(seen[p] for p in b.params) - t0 for b in buckets])
            for h in hooks:
                h.remove()
            comm = []  # communication only: every bucket queued at once on its engine
            for _ in range(3):
                dist.barrier()
                t0 = perf.clock(dev)
                for h in [net.reduce_async(b) for b in buckets]:
                    h.wait()
                comm.append(perf.clock(dev) - t0)
            alone = []  # each bucket's reduction by itself
            for b in buckets:
                ts = []
                for _ in range(3):
                    dist.barrier()
                    t0 = perf.clock(dev)
                    net.reduce_async(b).wait()
                    ts.append(perf.clock(dev) - t0)
                alone.append(statistics.median(ts))
            ready = [statistics.median(r) for r in zip(*ready)]
            row.update(compute=statistics.median(comp), comm=statistics.median(comm),
                       engine=net.engine_kind[0], buckets=[b.flat.numel() for b in buckets],
                       bound=_bound(statistics.median(comp), ready, alone))
            if net.selector is not None:
                row["auto_choice"] = list(net.selector.choice)
            net.close()  # joins the engine and destroys its group before the next config
        each = [None] * dist.get_world_size()
        dist.all_gather_object(each, row)
        if rank == 0:
            per_step = [max(ts) for ts in zip(*(e["times"] for e in each))]
            row.update(perf.summary(per_step))
            row["loss"] = statistics.mean(e["loss"] for e in each)
            for k in ("compute", "comm", "bound"):
                if k in row:
                    row[k] = max(e[k] for e in each)
            rows.append(row)
        del net, opt
    if rank == 0:
        atomic_write_text(job["out"], json.dumps(rows))
    netns.finish_group()


def run(links=("1gbit", "loopback"), configs=CONFIGS, batch: int = 128, steps: int = 8,
        warmup: int = 4, timeout: float = 1800, bucket_mb: float | None = None) -> dict:
    out = []
    for link in links:
        with tempfile.TemporaryDirectory() as d:
            job = {"configs": list(configs), "batch": batch, "steps": steps, "warmup": warmup,
                   "timeout": timeout, "out": os.path.join(d, "r.json"), "bucket_mb": bucket_mb}
            try:
                netns.run_ranks(["-c", "from pyfast.benchmarks.dp import _worker; _worker()"],
                                2, link, timeout, env={"PYFAST_DP": json.dumps(job)})
            except netns.LinkUnavailable as e:
                out.append({"link": link, "skipped": str(e)})
                continue
            with open(job["out"]) as f:
                rows = json.load(f)
        base = {r["config"]: r["median_s"] for r in rows}
        for r in rows:
            r["link"] = link
            r["vs_ddp_fp16"] = base["ddp+fp16"] / r["median_s"] if "ddp+fp16" in base else None
            if "compute" in r:
                r["overlap_ratio"] = r["median_s"] / max(r["compute"], r["comm"])
                r["bound_ratio"] = r["median_s"] / r["bound"]
        out += rows
    return {"machine": perf.machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "pyfast": pyfast.__version__, "world": 2, "batch": batch, "steps": steps,
            "warmup": warmup, "model": "MLP 1024-2048-2048-1024-1024, 9.4M params",
            "bucket_mb": bucket_mb or "DataParallel's default", "rows": out}


def table(result: dict):
    from rich.markup import escape
    from rich.table import Table
    t = Table(title=f"data-parallel training step, 2 ranks x 1 thread, {result['model']}, batch "
                    f"{result['batch']}/rank, median of {result['steps']} steps after "
                    f"{result['warmup']}\n{result['machine']}")
    perf.columns(t, ("link", "config", "step ms", "vs DDP+fp16", "loss", "compute ms", "comm ms",
                     "step/max(comp,comm)", "bound ms", "step/bound"), left=("link", "config"))
    for r in result["rows"]:
        if "skipped" in r:
            t.add_row(r["link"], "-", f"skipped: {r['skipped']}")
            continue
        f = lambda k: f"{r[k] * 1e3:.0f}" if k in r else ""  # noqa: E731
        cfg = r["config"] + (f" ({r['engine']})" if "engine" in r else "") + \
            (f" {r['auto_choice']}" if "auto_choice" in r else "")
        g = lambda k: f"{r[k]:.2f}" if k in r else ""  # noqa: E731
        t.add_row(r["link"], escape(cfg), f("median_s"),
                  f"{r['vs_ddp_fp16']:.2f}x" if r.get("vs_ddp_fp16") else "",
                  f"{r['loss']:.4f}", f("compute"), f("comm"), g("overlap_ratio"), f("bound"),
                  g("bound_ratio"))
    return t


# ------------------------------------------------------------------ CPU time per step, split
# `pyfast bench dp --cpu-split`: gpt-small (seq 256, byte vocabulary, AdamW), 2 ranks x 1
# thread on loopback, per-rank batches 2 and 8: torch DDP (its defaults), DataParallel
# (compressor="none", its defaults; and with gradient_as_bucket_view=True) and the bare module (no reduction: the compute they share)
# step in turn, the order rotated each round. Per step: process CPU seconds (every thread:
# the engine's, gloo's) and the main thread's; DataParallel's main-thread time split by part
# (each part's own time, with wrappers this benchmark sets on the instance: nothing in the
# library measures itself). "hooks + rest" is main - bare - the parts: the per-parameter
# hooks, the readiness count and the noise of this shared machine.
CPU_PARTS = {"forward checks": ("_check_usable", "_sync_buffers"),  # parameter check, buffers
             "copy in": ("copy_in",), "launch": ("launch",), "finite check": ("local_ok",),
             "side band": ("_reduce_and_copy",), "wait + copy out": ("finish",)}


def _providers():
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pyfast.parallel.data import DataParallel
    views = lambda m: DataParallel(m, "none", gradient_as_bucket_view=True)  # noqa: E731
    return {"bare": lambda m: m, "DDP": DDP, "DataParallel": lambda m: DataParallel(m, "none"),
            # DDP's bucket size (25 MB after a 1 MB first, as DataParallel's): how much of the
            # difference is the number of collectives (gpt-small: 22 buckets at 4 MB, 5 at 25)
            "DataParallel bucket_mb=25": lambda m: DataParallel(m, "none", bucket_mb=25),
            "DataParallel views": views, "DataParallel views, zero_grad(set_to_none=False)": views}


def _timed(obj, attr: str, acc: dict, key: str) -> None:
    """obj.attr wrapped: its main-thread CPU seconds add to acc[key] (the inner parts'
    included: _cpu_parts subtracts them)."""
    fn = getattr(obj, attr)

    def wrapper(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.thread_time() - t0
    setattr(obj, attr, wrapper)


def _instrument(net, acc: dict) -> None:
    b = net.bucketer
    for attr in ("_check_usable", "_sync_buffers", "_reduce_and_copy"):
        _timed(net, attr, acc, attr)
    # Bucketer._launch (the copies, then launch_fn), called by the readiness engine
    _timed(*((b.ready, "launch_fn") if hasattr(b, "ready") else (b, "_launch")), acc, "copy_in")
    _timed(b, "launch_fn", acc, "launch")  # DataParallel._launch (flags, finite check, submit)
    _timed(net._guard, "local_ok", acc, "local_ok")
    _timed(b, "finish", acc, "finish")


def _cpu_parts(acc: dict) -> dict:
    """Each part's own seconds (nested calls subtracted), by CPU_PARTS name."""
    own = dict(acc)
    own["copy_in"] -= acc["launch"]
    own["launch"] -= acc["local_ok"]
    own["_reduce_and_copy"] -= acc["finish"]  # the side band's all-reduce, wait and read
    return {name: sum(own[k] for k in keys) for name, keys in CPU_PARTS.items()}


def _cpu_worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pyfast import models
    from pyfast.parallel.data import DataParallel
    providers = _providers()
    job = json.loads(os.environ["PYFAST_DP_CPU"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    rank, seq = dist.get_rank(), job["seq"]
    out = {}
    for batch in job["batches"]:
        g = torch.Generator().manual_seed(rank)
        data = [torch.randint(0, 256, (batch, seq + 1), generator=g) for _ in range(2)]
        nets, acc = {}, {}
        for name, wrap in providers.items():
            torch.manual_seed(0)
            net = wrap(models.build(job["model"], 256, seq))
            nets[name] = (net, torch.optim.AdamW(net.parameters(), lr=1e-4))
            if isinstance(net, DataParallel):
                acc[name] = {k: 0.0 for keys in CPU_PARTS.values() for k in keys}
                _instrument(net, acc[name])
        rec = {n: {"wall": [], "proc": [], "main": [], "parts": []} for n in nets}
        names = list(nets)
        for r in range(job["warmup"] + job["steps"]):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                net, opt = nets[name]
                x = data[r % 2]
                dist.barrier()
                for a in acc.values():
                    a.update(dict.fromkeys(a, 0.0))
                w0, p0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
                opt.zero_grad(set_to_none="set_to_none=False" not in name)
                F.cross_entropy(net(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
                opt.step()
                if r >= job["warmup"]:
                    rec[name]["wall"].append(time.perf_counter() - w0)
                    rec[name]["proc"].append(time.process_time() - p0)
                    rec[name]["main"].append(time.thread_time() - t0)
                    if name in acc:
                        rec[name]["parts"].append(_cpu_parts(acc[name]))
        med = statistics.median
        row = {n: {k: med(v[k]) for k in ("wall", "proc", "main")} for n, v in rec.items()}
        for name in acc:
            nets[name][0].close()
            row[name]["parts"] = {k: med(p[k] for p in rec[name]["parts"]) for k in CPU_PARTS}
        out[batch] = row
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, out)
    if rank == 0:
        atomic_write_text(job["out"], json.dumps(each))
    netns.finish_group()


def cpu_split(batches=(2, 8), steps: int = 6, warmup: int = 2, model: str = "gpt-small",
              seq: int = 256, timeout: float = 1800) -> dict:
    with tempfile.TemporaryDirectory() as d:
        job = {"batches": list(batches), "steps": steps, "warmup": warmup, "model": model,
               "seq": seq, "timeout": timeout, "out": os.path.join(d, "r.json")}
        netns.run_ranks(["-c", "from pyfast.benchmarks.dp import _cpu_worker; _cpu_worker()"],
                        2, "loopback", timeout, env={"PYFAST_DP_CPU": json.dumps(job)})
        with open(job["out"]) as f:
            each = json.load(f)
    rows = []
    for b in map(str, batches):  # the ranks' mean (both do the same work)
        for name in each[0][b]:
            rs = [e[b][name] for e in each]
            row = {"batch": int(b), "provider": name,
                   **{k: statistics.mean(r[k] for r in rs) for k in ("wall", "proc", "main")}}
            if "parts" in rs[0]:
                row["parts"] = {k: statistics.mean(r["parts"][k] for r in rs) for k in CPU_PARTS}
            rows.append(row)
        bare = {r["provider"]: r for r in rows if r["batch"] == int(b)}["bare"]
        for r in rows:
            if r["batch"] == int(b):
                r["over_bare"] = r["main"] - bare["main"]
                if "parts" in r:
                    r["parts"]["hooks + rest"] = r["over_bare"] - sum(r["parts"].values())
    return {"machine": perf.machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "pyfast": pyfast.__version__, "model": model, "seq": seq, "steps": steps,
            "warmup": warmup, "rows": rows}


def cpu_table(result: dict):
    from rich.table import Table
    parts = [*CPU_PARTS, "hooks + rest"]
    t = Table(title=f"CPU per rank-step, {result['model']} seq {result['seq']}, AdamW, 2 ranks x "
                    f"1 thread, loopback, median of {result['steps']} steps after "
                    f"{result['warmup']} (ranks' mean); ms\n{result['machine']}")
    perf.columns(t, ("batch/rank", "provider", "wall", "process CPU", "main thread",
                     "main - bare", *parts), left=("provider",))
    for r in result["rows"]:
        ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
        t.add_row(str(r["batch"]), r["provider"], ms(r["wall"]), ms(r["proc"]), ms(r["main"]),
                  ms(r["over_bare"]), *(ms(r["parts"][k]) if "parts" in r else "" for k in parts))
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench dp", description=__doc__)
    p.add_argument("--link", default="1gbit,loopback")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="DataParallel bucket_mb (default: DataParallel's own)")
    p.add_argument("--cpu-split", action="store_true",
                   help="instead: CPU per step of DataParallel(none) vs DDP on gpt-small, by part")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.cpu_split:
        return perf.finish(cpu_split(steps=a.steps, warmup=a.warmup), cpu_table, a.out, width=200)
    res = run(a.link.split(","), a.configs.split(","), a.batch, a.steps, a.warmup,
              bucket_mb=a.bucket_mb)
    return perf.finish(res, table, a.out, width=170)


if __name__ == "__main__":
    raise SystemExit(main())
