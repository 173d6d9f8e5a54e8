"""DataParallel's per-step cost against DDP's on one GPU (issue 25), where a small model's step
is tens of milliseconds and the CPU only launches work: a fixed Python cost shows here as it
never does on a CPU rank. A world of one on NCCL (one GPU cannot hold two NCCL ranks): both
wrappers still bucket, launch and wait for every all-reduce; "bare" is the same model and
optimizer with no wrapper (the floor). Configurations alternate inside each round, and each
reports the median over rounds of wall ms a step (synchronised at the end of a block), the
main thread's CPU ms a step, and the process's.

    python tools/gpu_dp_vs_ddp.py --device cuda --batches 2,8 --rounds 7 --steps 20
    python tools/gpu_dp_vs_ddp.py --device cpu --model gpt-tiny --rounds 2 --steps 3   # a smoke run
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from pyfast import models
from pyfast.parallel.data import DataParallel

CONFIGS = {  # name -> wrapper(model, device)
    "bare": lambda m, d: m,
    "torch DDP": lambda m, d: DDP(m, device_ids=[d] if d.type == "cuda" else None),
    "torch DDP view": lambda m, d: DDP(m, device_ids=[d] if d.type == "cuda" else None,
                                       gradient_as_bucket_view=True),
    "pyfast none": lambda m, d: DataParallel(m, "none"),
    "pyfast none python": lambda m, d: DataParallel(m, "none", engine="python"),
    "pyfast none view": lambda m, d: DataParallel(m, "none", gradient_as_bucket_view=True),
    "pyfast none 4MB": lambda m, d: DataParallel(m, "none", bucket_mb=4),
    "pyfast auto": lambda m, d: DataParallel(m, "auto"),
}


def block(model, opt, ids, steps: int, device) -> tuple[float, float, float]:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sync()
    w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(steps):
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    w, t, p = time.perf_counter() - w0, time.thread_time() - t0, time.process_time() - p0
    return 1e3 * w / steps, 1e3 * t / steps, 1e3 * p / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batches", default="2,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:  # NCCL binds to an indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    names = a.configs.split(",")
    rows = []
    for batch in [int(b) for b in a.batches.split(",")]:
        torch.manual_seed(0)
        base = models.build(a.model, vocab_size=256, seq_len=a.seq).to(device)
        ids = torch.randint(0, 256, (batch, a.seq + 1), device=device)
        runs = {}
        for n in names:
            m = CONFIGS[n](copy.deepcopy(base), device)
            runs[n] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4))
            block(*runs[n], ids, 3, device)  # warm-up: allocator, NCCL communicator, autotune
        got = {n: [] for n in names}
        for r in range(a.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for n in order:
                got[n].append(block(*runs[n], ids, a.steps, device))
        ddp = statistics.median(x[0] for x in got.get("torch DDP", [(float("nan"),) * 3]))
        for n in names:
            w, t, p = (statistics.median(x[i] for x in got[n]) for i in range(3))
            rows.append(dict(batch=batch, config=n, wall_ms=w, main_cpu_ms=t, proc_cpu_ms=p,
                             speed_vs_ddp=ddp / w,
                             walls=[x[0] for x in got[n]]))
            print(f"batch {batch:2d}  {n:20s} wall {w:7.2f} ms  main-thread CPU {t:7.2f} ms  "
                  f"process CPU {p:7.2f} ms  speed vs DDP {ddp / w:5.3f}", flush=True)
        for m, _ in runs.values():
            if isinstance(m, DataParallel):
                m.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda"
                       else "cpu", "torch": torch.__version__, "args": vars(a), "rows": rows},
                      f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
