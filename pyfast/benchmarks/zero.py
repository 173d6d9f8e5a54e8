"""Sharded data parallelism (`pyfast bench zero`): pyfast.parallel.zero stages 1/2/3
(uncompressed, int8 gradients, int8 gradients + int8 parameters) against torch DDP,
ZeroRedundancyOptimizer + DDP and FSDP2 `fully_shard` (per block + root), same model, same
data, AdamW, 2 ranks x 1 thread, on plain loopback and on an emulated link.

Step: forward + backward + opt.step() + opt.zero_grad(set_to_none=True); median over the
timed steps of the slowest rank's step (a barrier before each). All providers are built in one
launch per link and take their steps in turn (round robin), so they see the same load on the
shared machine. On an emulated link the bytes a step puts on it are counted from the
namespace's lo (rank 0's view is the whole namespace) and `floor` = bytes / rate.

Memory, per rank, max over the ranks, from a launch of its own per provider (glibc's mmap
threshold pinned to 64 KB so that freed tensors leave the RSS; pinned, it makes every big
allocation fault its pages, so that launch is never timed):
  state    bytes of the tensors the ZeRO model counts, after backward and before opt.step()
           (where this step's gradients and the moments coexist): parameters (a DTensor's
           local shard), gradients, everything the optimizer holds (its state, its own
           parameters, e.g. master shards, and their gradients; those of an optimizer it
           wraps); each storage counted once (a master shard that is a view of its parameter
           counts as the parameter)
  rss      RSS between steps (after zero_grad) above the RSS before the provider was built
  peak     the RSS high-water mark during a step (/proc/self/clear_refs reset before it) above
           the same baseline: state + activations + communication buffers + gathered parameters
The ZeRO model in fp32 (no separate master copy needed: parameters are fp32): 4 bytes of
parameter, 4 of gradient and 8 of Adam moments per parameter, sharded over N ranks from stage
1 (moments), 2 (+ gradients), 3 (+ parameters): 16, 8 + 8/N, 4 + 12/N, 16/N bytes a parameter
(issue 12's 4 + 12/N and 2 + 14/N are the ZeRO paper's mixed-precision counts: 2-byte
parameters and gradients, 12 bytes of fp32 master and moments).

The first step's loss of every provider must equal DDP's within 1e-4 (int8 parameters: within
0.05, they change the forward) before anything is timed.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import statistics
import tempfile
import time

import pyfast
from pyfast import perf
from pyfast._io import atomic_write_text
from pyfast import netns

PEERS = ["torch DDP", "torch DDP+ZeroRedundancyOptimizer", "torch FSDP2"]
PYFAST = {"pyfast zero1": dict(stage=1), "pyfast zero2": dict(stage=2),
          "pyfast zero3": dict(stage=3), "pyfast zero2 int8": dict(stage=2, compressor="int8"),
          "pyfast zero3 int8+int8p": dict(stage=3, compressor="int8", param_compressor="int8")}
CONFIGS = [*PEERS, *PYFAST]
# `pyfast bench zero_offload` (zero_offload.py): known to the workers, not in the default CONFIGS
OFFLOAD = {"pyfast zero2 offload": dict(stage=2, offload="optimizer"),
           "pyfast zero2 offload delay": dict(stage=2, offload="optimizer", delay=True),
           # stage 3's parameter offload (docs/offload.md): bench/results/zero3_offload_params*
           "pyfast zero3 offload": dict(stage=3, offload="optimizer"),
           "pyfast zero3 offload params": dict(stage=3, offload="params"),
           "pyfast zero3 offload params p2": dict(stage=3, offload="params", prefetch=2)}
PYFAST.update(OFFLOAD)
STAGE = {"torch DDP": 0, "torch DDP+ZeroRedundancyOptimizer": 1, "torch FSDP2": 3,
         **{k: v["stage"] for k, v in PYFAST.items()}}
MODEL = dict(n_layer=8, n_head=8, d_model=512)  # 25.5M parameters with 256 byte tokens
TOL, TOL_PARAM_COMPRESSED = 1e-4, 0.05
LR = 1e-3


def model_bytes_per_param(stage: int, world: int) -> float:
    """The fp32 ZeRO model: parameter 4, gradient 4, Adam moments 8 bytes a parameter, the
    moments sharded from stage 1, the gradients from 2, the parameters from 3."""
    return (4 / world if stage >= 3 else 4) + (4 / world if stage >= 2 else 4) + \
        (8 / world if stage >= 1 else 8)


def build_model(seq: int, model: dict | None = None):
    import torch

    from pyfast.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**(model or MODEL), seq_len=seq))


def _wrap(name: str, model):
    """(module to call, optimizer, close) for a provider around a freshly built model."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    if name in PYFAST:
        from pyfast.parallel.zero import zero
        net, opt = zero(model, torch.optim.AdamW, lr=LR, **PYFAST[name])
        return net, opt, getattr(net, "close", lambda: None)
    if name == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard
        for block in list(model)[1:-1]:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=LR), lambda: None
    net = DDP(model)
    if name == "torch DDP":
        return net, torch.optim.AdamW(model.parameters(), lr=LR), lambda: None
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return net, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=LR), lambda: None


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard


def state_bytes(model, opt) -> dict:
    """{"params", "grads", "optimizer"}: bytes of the storages each holds (a storage counted
    once, in the first of these it appears in). Optimizers inside `opt` (an attribute that is
    a torch Optimizer: ZeroRedundancyOptimizer.optim, a wrapper's inner one) are included."""
    import torch
    seen: set = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind, t):
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            return
        seen.add(s.data_ptr())
        out[kind] += s.nbytes()

    for p in model.parameters():
        add("params", p)
    for p in model.parameters():
        add("grads", p.grad)

    def walk(o, depth=0):
        for g in o.param_groups:
            for p in g["params"]:
                add("optimizer", p)
                add("optimizer", p.grad)
        for st in o.state.values():
            for v in (st.values() if isinstance(st, dict) else [st]):
                add("optimizer", v)
        if depth < 3:
            for v in vars(o).values():
                if isinstance(v, torch.optim.Optimizer) and v is not o:
                    walk(v, depth + 1)
    walk(opt)
    return out


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    with open("/proc/self/status") as f:
        s = f.read()
    return tuple(int(re.search(rf"{k}:\s+(\d+) kB", s)[1]) * 1024 for k in ("VmRSS", "VmHWM"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _data(job, rank):
    import torch
    g = torch.Generator().manual_seed(1234 + rank)
    x = [torch.randint(0, 256, (job["batch"], job["seq"] + 1), generator=g) for _ in range(4)]
    return [(t[:, :-1], t[:, 1:]) for t in x]


def _backward(net, x, y):
    import torch.nn.functional as F
    loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss


def _step(net, opt, x, y):
    loss = _backward(net, x, y)
    opt.step()
    return loss


def _mean(v: float) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _gather_max(rank, row: dict, keys) -> dict:
    import torch.distributed as dist
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, row)
    return {k: max(e[k] for e in each) for k in keys}


def _memory(job, rank, data):
    """One provider alive at a time: state bytes, RSS between steps and the peak during one."""
    import torch.distributed as dist
    rows = []
    for name in job["configs"]:
        gc.collect()
        base, _ = _rss()
        model = build_model(job["seq"], job["model"])
        net, opt, close = _wrap(name, model)
        losses, peaks = [], []
        for i in range(job["mem_steps"]):
            x, y = data[i % len(data)]
            dist.barrier()
            _reset_peak()
            loss = _backward(net, x, y)
            if i == job["mem_steps"] - 1:
                st = state_bytes(model, opt)
            opt.step()
            peaks.append(_rss()[1] - base)
            opt.zero_grad(set_to_none=True)
            losses.append(_mean(float(loss)))
        rss = _rss()[0] - base
        mine = {**st, "state": sum(st.values()), "rss": rss, "peak": max(peaks[1:] or peaks)}
        row = {"config": name, "losses": losses, **_gather_max(rank, mine, mine)}
        rows.append(row)
        close()
        # the loss's graph reaches the parameters (AccumulateGrad): drop it with the rest
        del net, opt, model, close, loss
    return rows


def _timing(job, rank, data):
    """Every provider built, then warm-up steps and timed steps in turn (round robin)."""
    import torch.distributed as dist
    emulated = bool(os.environ.get("PYFAST_NETNS"))
    provs = {}
    for name in job["configs"]:
        model = build_model(job["seq"], job["model"])
        provs[name] = (*_wrap(name, model),)
    times = {n: [] for n in provs}
    sent = {n: [] for n in provs}
    first = {}
    for i in range(job["warmup"] + job["steps"]):
        x, y = data[i % len(data)]
        for name, (net, opt, _) in provs.items():
            dist.barrier()
            s0 = netns.lo_tx_bytes() if emulated else 0
            t0 = perf.clock(x.device)
            loss = _step(net, opt, x, y)
            opt.zero_grad(set_to_none=True)
            dt = perf.clock(x.device) - t0
            dist.barrier()
            if i == 0:
                first[name] = _mean(float(loss))
            if i >= job["warmup"]:
                times[name].append(dt)
                if emulated:
                    sent[name].append(netns.lo_tx_bytes() - s0)
    rows = []
    for name, (_, _, close) in provs.items():
        each = [None] * dist.get_world_size()
        dist.all_gather_object(each, times[name])
        per_step = [max(ts) for ts in zip(*each)]
        row = {"config": name, "loss0": first[name], "times": per_step, **perf.summary(per_step)}
        if emulated and rank == 0:
            row["link_bytes"] = statistics.median(sent[name])
        rows.append(row)
        close()
    return rows


def _worker() -> None:
    import torch
    import torch.distributed as dist
    job = json.loads(os.environ["PYFAST_ZERO"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    rank = dist.get_rank()
    data = _data(job, rank)
    rows = (_memory if job["phase"] == "memory" else _timing)(job, rank, data)
    if rank == 0:
        atomic_write_text(job["out"], json.dumps(rows))
    netns.finish_group()


def _launch(phase: str, link: str, job: dict, env: dict | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        job = {**job, "phase": phase, "out": os.path.join(d, "r.json")}
        netns.run_ranks(["-c", "from pyfast.benchmarks.zero import _worker; _worker()"], 2,
                        link, job["timeout"], env={"PYFAST_ZERO": json.dumps(job), **(env or {})},
                        fork=phase != "memory")  # memory: fresh processes (netns.ranks)
        with open(job["out"]) as f:
            return json.load(f)


def _check_losses(rows: list[dict], key) -> None:
    """Every provider's first-step loss against DDP's: a wrong sharding is never timed."""
    ref = next((key(r) for r in rows if r["config"] == "torch DDP"), None)
    if ref is None:
        return
    for r in rows:
        tol = TOL_PARAM_COMPRESSED if PYFAST.get(r["config"], {}).get("param_compressor") else TOL
        r["loss0_diff"] = abs(key(r) - ref)
        if r["loss0_diff"] > tol:
            raise RuntimeError(f"{r['config']}: first-step loss {key(r):.6f} differs from torch "
                               f"DDP's {ref:.6f} by more than {tol}")


def run(links=("loopback", "1gbit"), configs=CONFIGS, batch: int = 2, seq: int = 128,
        steps: int = 5, warmup: int = 2, mem_steps: int = 2, timeout: float = 1800,
        model: dict | None = None) -> dict:
    model = model or MODEL
    for link in links:
        netns.rate_bps(link)  # a bad link string fails before anything runs
    job = {"configs": list(configs), "batch": batch, "seq": seq, "steps": steps,
           "warmup": warmup, "mem_steps": mem_steps, "timeout": timeout, "model": model}
    n_params = sum(p.numel() for p in build_model(seq, model).parameters())
    # one launch per provider: memory a provider freed is not always back in the RSS when the
    # next one starts (measured: FSDP2 after DDP showed 154 MB between steps, first 330 MB)
    memory = [row for c in configs for row in
              _launch("memory", "loopback", {**job, "configs": [c]},
                      {"MALLOC_MMAP_THRESHOLD_": "65536"})]
    _check_losses(memory, lambda r: r["losses"][0])
    for r in memory:
        r["model_bytes"] = model_bytes_per_param(STAGE[r["config"]], 2) * n_params
        r["state_vs_model"] = r["state"] / r["model_bytes"]
    fsdp_mem = next((r for r in memory if r["config"] == "torch FSDP2"), None)
    for r in memory:
        if fsdp_mem:
            r["peak_vs_fsdp2"] = r["peak"] / fsdp_mem["peak"]
            r["state_vs_fsdp2"] = r["state"] / fsdp_mem["state"]
    rows = []
    for link in links:
        try:
            got = _launch("timing", link, job)
        except netns.LinkUnavailable as e:
            rows.append({"link": link, "skipped": str(e)})
            continue
        _check_losses(got, lambda r: r["loss0"])
        fsdp = next((r["median_s"] for r in got if r["config"] == "torch FSDP2"), None)
        bps = netns.rate_bps(link)
        for r in got:
            r["link"] = link
            r["vs_fsdp2"] = fsdp / r["median_s"] if fsdp else None
            if "link_bytes" in r and bps:
                r["floor_s"] = r["link_bytes"] * 8 / bps
        rows += got
    return {"machine": perf.machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "pyfast": pyfast.__version__, "world": 2, "batch": batch, "seq": seq, "steps": steps,
            "warmup": warmup, "mem_steps": mem_steps, "params": n_params,
            "model": f"GPT n_layer={model['n_layer']} d_model={model['d_model']} "
                     f"n_head={model['n_head']}, {n_params / 1e6:.1f}M params",
            "memory": memory, "rows": rows}


def table(result: dict):
    from rich.console import Group
    setup = (f"2 ranks x 1 thread, {result['model']}, AdamW, batch {result['batch']} x "
             f"{result['seq']} tokens/rank")
    t = perf.rich_table(f"ZeRO training step, median of {result['steps']} steps after "
                        f"{result['warmup']}, slowest rank, round robin; {setup}", result,
                        ("link", "config", "step ms", "q10-q90 ms", "vs FSDP2",
                         "MB on link/step", "floor ms", "loss0 - DDP's"), left=("link", "config"))
    for r in result["rows"]:
        if "skipped" in r:
            t.add_row(r["link"], "-", f"skipped: {r['skipped']}")
            continue
        t.add_row(r["link"], r["config"], f"{r['median_s'] * 1e3:.0f}",
                  f"{r['q10_s'] * 1e3:.0f}-{r['q90_s'] * 1e3:.0f}",
                  f"{r['vs_fsdp2']:.2f}x" if r.get("vs_fsdp2") else "",
                  f"{r['link_bytes'] / 1e6:.0f}" if "link_bytes" in r else "",
                  f"{r['floor_s'] * 1e3:.0f}" if "floor_s" in r else "",
                  f"{r['loss0_diff']:.1e}" if "loss0_diff" in r else "")
    m = perf.rich_table("ZeRO memory per rank (max over ranks), MB: state after backward, before "
                        "opt.step(); rss and peak above the RSS before the model was built",
                        result, ("config", "params", "grads", "optimizer", "state", "ZeRO model",
                                 "state/model", "rss between steps", "peak in step",
                                 "peak vs FSDP2"), left=("config",))
    mb = lambda v: f"{v / 1e6:.0f}"  # noqa: E731
    for r in result["memory"]:
        m.add_row(r["config"], mb(r["params"]), mb(r["grads"]), mb(r["optimizer"]),
                  mb(r["state"]), mb(r["model_bytes"]), f"{r['state_vs_model']:.2f}",
                  mb(r["rss"]), mb(r["peak"]),
                  f"{r['peak_vs_fsdp2']:.2f}x" if "peak_vs_fsdp2" in r else "")
    return Group(t, m)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench zero", description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="loopback,1gbit")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mem-steps", type=int, default=2,
                   help="steps of the memory launch (the peak: the largest after the first)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    configs = a.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS and c not in OFFLOAD]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    res = run(a.link.split(","), configs, a.batch, a.seq, a.steps, a.warmup, a.mem_steps)
    return perf.finish(res, table, a.out, width=170)


if __name__ == "__main__":
    raise SystemExit(main())
