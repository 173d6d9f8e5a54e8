"""What fp16 loss scaling costs a ZeRO step (issue 33, item 4): gpt-small (V=256, seq 128,
batch 4 a rank), zero(stage=2, compressor="int8"), 2 gloo ranks x 1 thread, fp32 compute so
the three variants do the same arithmetic, interleaved step by step in one process:

- plain:  loss.backward(); opt.step()                          (no scaler, memory not staged)
- staged: the same with ZeroModel.stage_feedback(True)         (the feedback memory staged)
- scaler: ZeroGradScaler: scale, backward, unscale_ (+ the found_inf all-reduce), step, update

    PYTHONPATH=$PWD python bench/zero_fp16.py RUN   -> bench/results/zero_fp16_RUN.{txt,json}
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("plain", "staged", "scaler")
STEPS, WARM, VOCAB, SEQ, BATCH = int(os.environ.get("ZF_STEPS", 12)), 2, 256, 128, 4


def _rank(rank, world, port, q):
    import torch.nn.functional as F

    from pyfast.models import build
    from pyfast.parallel.zero import zero
    from pyfast.parallel.zero.scaler import ZeroGradScaler
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model, opt = zero(build("gpt-small", VOCAB, SEQ), torch.optim.AdamW, stage=2,
                      compressor="int8", lr=1e-4)
    scaler = ZeroGradScaler("cpu", optimizer=opt)
    g = torch.Generator().manual_seed(rank)
    times = {v: [] for v in VARIANTS}
    for i in range(WARM + STEPS):
        for v in VARIANTS:
            b = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
            model.stage_feedback(v != "plain")
            dist.barrier()
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
            if v == "scaler":
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step
            if i >= WARM:
                times[v].append(t.item())
    fb = model.compressor.feedback
    mem = sum(t.numel() * 4 for t in [*fb.memory.values(), *fb._spare.values()])
    if rank == 0:
        q.put({"times": times, "feedback_bytes_staged": mem,
               "n_params": sum(p.numel() for p in model.parameters())})
    model.close()
    dist.destroy_process_group()


def main(run: str) -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    ps = [ctx.Process(target=_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    res = q.get(timeout=900)
    for p in ps:
        p.join()
    med = {v: statistics.median(ts) for v, ts in res["times"].items()}
    # per step i, each variant against plain in the same round: the ratios' median
    ratio = {v: statistics.median(a / b for a, b in zip(res["times"][v], res["times"]["plain"]))
             for v in VARIANTS}
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    lines = [f"# fp16 loss scaling under zero(stage=2, compressor='int8'): run {run}, {stamp}",
             f"# {cpu}, {os.cpu_count()} cores, torch {torch.__version__}; 2 gloo ranks x 1 "
             f"thread; gpt-small ({res['n_params']:,} params, V={VOCAB}), seq {SEQ}, batch "
             f"{BATCH} a rank, fp32 compute; {STEPS} rounds after {WARM} warm-up, the variants "
             "interleaved; slowest rank's step; other helpers' niced jobs on the box",
             f"{'variant':>8} {'median s':>9} {'x plain (median of per-round ratios)':>38}"]
    lines += [f"{v:>8} {med[v]:9.3f} {ratio[v]:38.3f}" for v in VARIANTS]
    lines.append(f"# feedback memory while staged: {res['feedback_bytes_staged'] / 1e6:.1f} MB "
                 f"a rank (memory + spare; unstaged: half of it)")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path("bench/results")
    (out / f"zero_fp16_{run}.txt").write_text(text)
    (out / f"zero_fp16_{run}.json").write_text(json.dumps(
        {"run": run, "stamp": stamp, "machine": cpu, "median_s": med, "ratio_to_plain": ratio,
         **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "a"))
