"""End-to-end data parallel training step (`pyfast bench dp`): pyfast DataParallel (none, int8,
topk + error feedback, auto) against torch DDP (plain, fp16_compress_hook, powerSGD_hook rank
4), same model, same data, same run, 2 ranks with one thread each, on a link.

Also per pyfast config: compute-only step (forward + backward, no reduction) and
communication-only time (every bucket's reduction, back to back, no compute), so the overlap
target (step <= 1.15 x max(compute, comm)) can be checked.
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
from pyfast.benchmarks import netns

CONFIGS = ["ddp", "ddp+fp16", "ddp+powersgd:4", "pyfast:none", "pyfast:int8",
           "pyfast:topk:0.01", "pyfast:auto"]


def build(seed: int = 0):
    import torch
    from torch import nn
    torch.manual_seed(seed)  # ~9.4M parameters, 37.7 MB of fp32 gradients
    return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                         nn.Linear(2048, 1024), nn.GELU(), nn.Linear(1024, 1024))


def _wrap(cfg: str, m):
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as dh
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as ph
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pyfast.parallel.data import DataParallel
    if cfg.startswith("pyfast:"):
        return DataParallel(m, cfg.split(":", 1)[1])
    net = DDP(m)
    if cfg == "ddp+fp16":
        net.register_comm_hook(None, dh.fp16_compress_hook)
    elif cfg.startswith("ddp+powersgd"):
        state = ph.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        net.register_comm_hook(state, ph.powerSGD_hook)
    return net


def _worker() -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from pyfast.comm import all_reduce
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
        net = _wrap(cfg, m)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        times = []
        for step in range(job["warmup"] + job["steps"]):
            x, y = data[step % 4], targets[step % 4]
            dist.barrier()
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        row = {"config": cfg, "times": times[job["warmup"]:], "loss": float(loss)}
        if cfg.startswith("pyfast:"):
            comp = []  # compute only: the same step with no reduction
            for step in range(3):
                t0 = time.perf_counter()
                with net.no_sync():
                    nn.functional.mse_loss(net(data[0]), targets[0]).backward()
                comp.append(time.perf_counter() - t0)
            comm = []  # communication only: every bucket, back to back, as configured
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                for b in net.bucketer.buckets:
                    c = net.selector.compressor(b) if net.selector else net.compressor
                    all_reduce(b.flat, c, op="avg", name=b.name)
                comm.append(time.perf_counter() - t0)
            row.update(compute=statistics.median(comp), comm=statistics.median(comm))
            if net.selector is not None:
                row["auto_choice"] = list(net.selector.choice)
        each = [None] * dist.get_world_size()
        dist.all_gather_object(each, row)
        if rank == 0:
            per_step = [max(ts) for ts in zip(*(e["times"] for e in each))]
            row["step_s"] = statistics.median(per_step)
            row["loss"] = statistics.mean(e["loss"] for e in each)
            for k in ("compute", "comm"):
                if k in row:
                    row[k] = max(e[k] for e in each)
            rows.append(row)
        del net, opt
    if rank == 0:
        with open(job["out"], "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def run(links=("1gbit", "loopback"), configs=CONFIGS, batch: int = 128, steps: int = 8,
        warmup: int = 4, timeout: float = 1800) -> dict:
    out = []
    for link in links:
        with tempfile.TemporaryDirectory() as d:
            job = {"configs": list(configs), "batch": batch, "steps": steps, "warmup": warmup,
                   "timeout": timeout, "out": os.path.join(d, "r.json")}
            try:
                netns.run_ranks(["-c", "from pyfast.benchmarks.dp import _worker; _worker()"],
                                2, link, timeout, env={"PYFAST_DP": json.dumps(job)})
            except netns.LinkUnavailable as e:
                out.append({"link": link, "skipped": str(e)})
                continue
            with open(job["out"]) as f:
                rows = json.load(f)
        base = {r["config"]: r["step_s"] for r in rows}
        for r in rows:
            r["link"] = link
            r["vs_ddp_fp16"] = base["ddp+fp16"] / r["step_s"] if "ddp+fp16" in base else None
            if "compute" in r:
                r["overlap_ratio"] = r["step_s"] / max(r["compute"], r["comm"])
        out += rows
    return {"machine": perf.machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "pyfast": pyfast.__version__, "world": 2, "batch": batch, "steps": steps,
            "warmup": warmup, "model": "MLP 1024-2048-2048-1024-1024, 9.4M params", "rows": out}


def table(result: dict):
    from rich.table import Table
    t = Table(title=f"data-parallel training step, 2 ranks x 1 thread, {result['model']}, batch "
                    f"{result['batch']}/rank, median of {result['steps']} steps after "
                    f"{result['warmup']}\n{result['machine']}")
    for col in ("link", "config", "step ms", "vs DDP+fp16", "loss", "compute ms", "comm ms",
                "step/max(comp,comm)"):
        t.add_column(col, justify="left" if col in ("link", "config") else "right")
    for r in result["rows"]:
        if "skipped" in r:
            t.add_row(r["link"], "-", f"skipped: {r['skipped']}")
            continue
        f = lambda k: f"{r[k] * 1e3:.0f}" if k in r else ""  # noqa: E731
        cfg = r["config"] + (f" {r['auto_choice']}" if "auto_choice" in r else "")
        t.add_row(r["link"], cfg, f("step_s"), f"{r['vs_ddp_fp16']:.2f}x", f"{r['loss']:.4f}",
                  f("compute"), f("comm"),
                  f"{r['overlap_ratio']:.2f}" if "overlap_ratio" in r else "")
    return t


def main(argv=None) -> int:
    from rich.console import Console
    p = argparse.ArgumentParser(prog="pyfast bench dp", description=__doc__)
    p.add_argument("--link", default="1gbit,loopback")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    res = run(a.link.split(","), a.configs.split(","), a.batch, a.steps)
    Console(width=170).print(table(res))
    if a.out:
        perf.save_result(res, a.out, table, width=170)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
