"""The native engine on CPU tensors over gloo, as small as it gets: one all-reduce per
compressor kind at 2 ranks. A diagnosis aid for a machine where tests/test_engine.py's ranks die
(the lent H200's toolchain, 2026-11-25/26): run each rank by hand, one under a debugger.

    python tools/engine_cpu_smoke.py RANK WORLD [PORT]
"""
import os
import sys

import torch
import torch.distributed as dist

rank, world = int(sys.argv[1]), int(sys.argv[2])
port = sys.argv[3] if len(sys.argv) > 3 else "29531"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
from pyfast.comm.engine import NativeEngine  # noqa: E402

engine = NativeEngine()
for kind in ["none", "fp16", "int8", "sign"]:
    x = torch.randn(70_007, generator=torch.Generator().manual_seed(rank))
    print(f"rank {rank}: {kind} submit", flush=True)
    h = engine.all_reduce(x, kind, "sum", name=f"g.{kind}")
    h.wait()
    print(f"rank {rank}: {kind} done, sum {float(x.sum()):.4f}", flush=True)
engine.close()
dist.destroy_process_group()
print(f"rank {rank}: ok", flush=True)
