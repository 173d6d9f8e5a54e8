"""pyfast bench plan_memory: the planner's memory model (pyfast.plan.memory) against the dry run
and against real CPU allocations.

(a) GPU-shaped configurations (gpt-small to 7B-shaped, 8-64 ranks; dp, tp, pp with every
    schedule, cp ring/ulysses, ZeRO 1-3 on any of those meshes and with hybrid sharding
    (DRY_MESH, DRY_HYBRID: issue 33), compressors, activation checkpointing), fp32: the
    model's peak per rank (device="meta": the math attention the dry run traces) against
    pyfast.train.dryrun.dry_run's traced peak of the same rank. Target: within 10% each.
(b) Configurations that run here on 1, 2 and 4 gloo ranks: the model (device="cpu") against the
    peak of the real CPU allocations of the job's second step (pyfast.train.memory's
    MemoryTracker on real tensors, dryrun.measure); beside it the peak RSS growth over that
    step (VmHWM after /proc/self/clear_refs, less VmRSS before: glibc reuses what step 1
    freed, so it is below the allocations' peak).
    Target: within 15% each.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

from pyfast import perf

# (name, world, TrainConfig fields); vocab 256 (the default data's bytes), fp32
GPT124 = "gpt:layers=12,heads=12,hidden=768"
GPT350 = "gpt:layers=24,heads=16,hidden=1024"
GPT1B = "gpt:layers=24,heads=16,hidden=2048"
GPT7B = "gpt:layers=32,heads=32,hidden=4096"
ODD = "gpt:layers=5,heads=6,hidden=576,mlp=2"
DRY = [
    ("small dp8", dict(model="gpt-small", dp=8, seq=1024, batch=16)),
    ("small dp8 int8", dict(model="gpt-small", dp=8, seq=1024, batch=16, compress="int8")),
    ("small dp8 topk", dict(model="gpt-small", dp=8, seq=1024, batch=16, compress="topk:0.01")),
    ("small dp8 powersgd", dict(model="gpt-small", dp=8, seq=1024, batch=16,
                                compress="powersgd:4")),
    ("small tp2 dp4 int4", dict(model="gpt-small", dp=4, tp=2, seq=1024, batch=8,
                                compress="int4")),
    ("124M dp8 ckpt", dict(model=GPT124, dp=8, seq=1024, batch=32,
                           activation_checkpointing=True)),
    ("124M zero1 dp8", dict(model=GPT124, dp=8, zero=1, seq=1024, batch=16)),
    ("124M zero2 dp8 int8", dict(model=GPT124, dp=8, zero=2, seq=1024, batch=16,
                                 compress="int8")),
    ("124M zero3 dp16", dict(model=GPT124, dp=16, zero=3, seq=1024, batch=16)),
    ("124M zero3 dp8 pc-bf16", dict(model=GPT124, dp=8, zero=3, seq=1024, batch=8,
                                    param_compress="bf16")),
    ("350M tp8", dict(model=GPT350, tp=8, seq=2048, batch=2)),
    ("350M tp4 dp2 ckpt", dict(model=GPT350, tp=4, dp=2, seq=2048, batch=4,
                               activation_checkpointing=True)),
    ("350M pp4 dp2 1f1b", dict(model=GPT350, pp=4, dp=2, seq=1024, batch=16, micro_batches=8)),
    ("350M pp4 gpipe", dict(model=GPT350, pp=4, dp=2, seq=1024, batch=8, micro_batches=4,
                            schedule="gpipe")),
    ("350M pp4 zb-h1", dict(model=GPT350, pp=4, dp=2, seq=1024, batch=16, micro_batches=8,
                            schedule="zb-h1")),
    ("350M pp4 interleaved", dict(model=GPT350, pp=4, dp=2, seq=1024, batch=16,
                                  micro_batches=8, schedule="interleaved-1f1b")),
    ("350M cp4 ring dp2", dict(model=GPT350, cp=4, dp=2, seq=4096, batch=2)),
    ("350M cp8 ulysses", dict(model=GPT350, cp=8, seq=4096, batch=1, cp_method="ulysses")),
    ("350M pp2 dp4 powersgd", dict(model=GPT350, pp=2, dp=4, seq=1024, batch=16,
                                   micro_batches=4, compress="powersgd:8")),
    ("1.3B tp8", dict(model=GPT1B, tp=8, seq=2048, batch=1)),
    ("1.3B tp4 pp2 dp2", dict(model=GPT1B, tp=4, pp=2, dp=2, seq=2048, batch=8,
                              micro_batches=4)),
    ("1.3B zero3 dp32 ckpt", dict(model=GPT1B, dp=32, zero=3, seq=1024, batch=32,
                                  activation_checkpointing=True)),
    ("1.3B zero2 dp16 bf16", dict(model=GPT1B, dp=16, zero=2, seq=1024, batch=16,
                                  compress="bf16")),
    ("1.3B tp8 cp2 ring ckpt", dict(model=GPT1B, tp=8, cp=2, seq=4096, batch=1,
                                    activation_checkpointing=True)),
    ("7B tp8 pp4 1f1b", dict(model=GPT7B, tp=8, pp=4, seq=2048, batch=8, micro_batches=8)),
    ("7B tp8 pp4 dp2 ckpt", dict(model=GPT7B, tp=8, pp=4, dp=2, seq=4096, batch=16,
                                 micro_batches=8, activation_checkpointing=True)),
    ("7B tp8 pp8 interleaved", dict(model=GPT7B, tp=8, pp=8, seq=2048, batch=16,
                                    micro_batches=16, schedule="interleaved-1f1b")),
    ("7B tp4 pp8 zb-h1", dict(model=GPT7B, tp=4, pp=8, seq=1024, batch=8, micro_batches=8,
                              schedule="zb-h1")),
    ("7B zero3 dp64 ckpt", dict(model=GPT7B, dp=64, zero=3, seq=2048, batch=64,
                                activation_checkpointing=True)),
    ("7B zero3 dp32 cp2 ckpt", dict(model=GPT7B, dp=32, cp=2, zero=3, seq=2048, batch=32,
                                    activation_checkpointing=True)),
    ("7B tp8 dp8 int8 ckpt", dict(model=GPT7B, tp=8, dp=8, seq=2048, batch=8, compress="int8",
                                  activation_checkpointing=True)),
    ("7B tp8 cp4 ulysses ckpt", dict(model=GPT7B, tp=8, cp=4, seq=4096, batch=1,
                                     cp_method="ulysses", activation_checkpointing=True)),
    ("odd zero2 dp8 int4 tied", dict(model=ODD, dp=8, zero=2, seq=1536, batch=8,
                                     compress="int4", tie_embeddings=True)),
    ("odd tp3 pp3 dp2 ckpt", dict(model="gpt:layers=7,heads=6,hidden=576,mlp=3", tp=3, pp=3,
                                  dp=2, seq=2048, batch=6, micro_batches=3,
                                  activation_checkpointing=True)),
]
# issue 33: ZeRO on tp / pp / cp meshes (the dp x cp group of each tp / pp shard) and hybrid
# sharding (--zero-shard-group N, --compress across the groups); odd shapes among them
DRY_MESH = [
    ("124M zero2 dp8 2 micro-batches", dict(model=GPT124, dp=8, zero=2, seq=1024, batch=16,
                                            micro_batches=2)),
    ("350M zero1 tp2 dp4", dict(model=GPT350, tp=2, dp=4, zero=1, seq=1024, batch=8)),
    ("350M zero2 tp2 dp4 int8", dict(model=GPT350, tp=2, dp=4, zero=2, seq=1024, batch=8,
                                     compress="int8")),
    ("350M zero3 tp2 dp4 ckpt", dict(model=GPT350, tp=2, dp=4, zero=3, seq=1024, batch=8,
                                     activation_checkpointing=True)),
    ("350M zero2 pp4 dp2 1f1b", dict(model=GPT350, pp=4, dp=2, zero=2, seq=1024, batch=16,
                                     micro_batches=8)),
    ("350M zero3 pp2 dp2 gpipe", dict(model=GPT350, pp=2, dp=2, zero=3, seq=1024, batch=8,
                                      micro_batches=4, schedule="gpipe")),
    ("350M zero1 pp2 dp2 zb-h1", dict(model=GPT350, pp=2, dp=2, zero=1, seq=1024, batch=8,
                                      micro_batches=4, schedule="zb-h1")),
    ("350M zero3 cp2 tp2 dp2 ring", dict(model=GPT350, cp=2, tp=2, dp=2, zero=3, seq=2048,
                                         batch=4)),
    ("odd zero1 tp3 pp3 dp2 ckpt", dict(model="gpt:layers=7,heads=6,hidden=576,mlp=3", tp=3,
                                        pp=3, dp=2, zero=1, seq=2048, batch=6, micro_batches=3,
                                        activation_checkpointing=True)),
    ("1.3B zero2 tp4 pp2 dp2", dict(model=GPT1B, tp=4, pp=2, dp=2, zero=2, seq=2048, batch=8,
                                    micro_batches=4)),
]
# ZeRO under fp16 (ZeroGradScaler stages the error-feedback memory)
DRY_FP16 = [
    ("124M zero2 dp8 fp16 int8", dict(model=GPT124, dp=8, zero=2, seq=1024, batch=16,
                                      precision="fp16", compress="int8")),
    ("350M zero1 tp2 dp4 fp16", dict(model=GPT350, tp=2, dp=4, zero=1, seq=1024, batch=8,
                                     precision="fp16")),
]
# hybrid sharding (needs the job's --zero-shard-group)
DRY_HYBRID = [
    ("124M zero2 dp8 group4 int8", dict(model=GPT124, dp=8, zero=2, seq=1024, batch=16,
                                        compress="int8", zero_shard_group="4")),
    ("124M zero3 dp8 group2 int4", dict(model=GPT124, dp=8, zero=3, seq=1024, batch=16,
                                        compress="int4", zero_shard_group="2")),
    ("124M zero1 dp4 cp2 group2", dict(model=GPT124, dp=4, cp=2, zero=1, seq=2048, batch=8,
                                       zero_shard_group="2")),
    ("odd zero2 dp8 group4 topk tied", dict(model=ODD, dp=8, zero=2, seq=1536, batch=8,
                                            compress="topk:0.01", tie_embeddings=True,
                                            zero_shard_group="4")),
]
# (name, ranks, TrainConfig fields): small enough for this 2-core machine
REAL = [
    ("tiny 1 rank", 1, dict(model="gpt-tiny", seq=256, batch=4)),
    ("small 1 rank", 1, dict(model="gpt-small", seq=256, batch=2)),
    ("small 1 rank ckpt", 1, dict(model="gpt-small", seq=256, batch=4,
                                  activation_checkpointing=True)),
    ("small dp2", 2, dict(model="gpt-small", dp=2, seq=256, batch=4)),
    ("small dp2 int8", 2, dict(model="gpt-small", dp=2, seq=256, batch=4, compress="int8")),
    ("small zero2 dp2", 2, dict(model="gpt-small", dp=2, zero=2, seq=256, batch=4)),
    ("small zero3 dp4", 4, dict(model="gpt-small", dp=4, zero=3, seq=256, batch=4)),
    ("small tp2", 2, dict(model="gpt-small", tp=2, seq=256, batch=2)),
    ("small pp2 1f1b", 2, dict(model="gpt-small", pp=2, seq=256, batch=4, micro_batches=4)),
    # a ring (the last stage sends to the first): its sends are not waited as made on a CPU
    ("small pp3 interleaved", 3, dict(model="gpt-small", pp=3, seq=256, batch=6,
                                      micro_batches=6, schedule="interleaved-1f1b")),
    ("small cp2 ring", 2, dict(model="gpt-small", cp=2, seq=256, batch=2)),
    ("tiny dp2 pp2 topk", 4, dict(model="gpt-tiny", dp=2, pp=2, seq=256, batch=8,
                                  micro_batches=2, compress="topk:0.05")),
    ("small tp2 dp2", 4, dict(model="gpt-small", tp=2, dp=2, seq=128, batch=4)),
]


def plan_of(cfg, vocab: int = 256):
    """(ModelShape, Plan, Workload) of a TrainConfig (the reference GPT)."""
    from pyfast.models import PRESETS, gpt_shape
    from pyfast.plan.spec import ModelShape, Plan, Workload
    g = dict(PRESETS[cfg.model]) if cfg.model in PRESETS else gpt_shape(cfg.model)
    h = g["d_model"]
    shape = ModelShape(layers=g["n_layer"], hidden=h, heads=g["n_head"], kv_heads=g["n_head"],
                       ffn=g.get("mlp_ratio", 4) * h, vocab=vocab, tied=cfg.tie_embeddings)
    mb = cfg.batch // (cfg.dp * cfg.grad_accum * cfg.m)
    plan = Plan(dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, pp=cfg.pp, zero=cfg.zero,
                compress=cfg.compress, micro_batch=mb, micro_batches=cfg.m,
                schedule=cfg.schedule, activation_checkpointing=cfg.activation_checkpointing,
                cp_method=cfg.cp_method, param_compress=cfg.param_compress,
                sequence_parallel=cfg.sequence_parallel, lora=cfg.lora, base_dtype=cfg.base_dtype, lora_dropout=cfg.lora_dropout,
                base_placement="shard" if cfg.base_placement == "shard" else "replicate",
                shard_group=shard_n(cfg))
    return shape, plan, Workload(seq=cfg.seq, global_batch=cfg.batch, precision=cfg.precision)


def shard_n(cfg) -> int:
    """Plan.shard_group of --zero-shard-group N (0: the whole dp x cp group; "node" needs the
    node's size, which a dry run has not: give N)."""
    spec = str(getattr(cfg, "zero_shard_group", "") or "")
    if not spec:
        return 0
    if not spec.isdigit():
        raise ValueError(f"--zero-shard-group {spec}: the planner's check takes N, not {spec!r}")
    return 0 if int(spec) == cfg.dp * cfg.cp else int(spec)


def dry_ranks(cfg) -> list[int]:
    """One rank per pipeline stage (dp, cp, tp rank 0); with ZeRO the first and last shard."""
    n = cfg.dp * cfg.cp
    shards = [0, n - 1] if cfg.zero and n > 1 else [0]
    return [(s * n + d) * cfg.tp for s in range(cfg.pp) for d in shards]


def stage_of(cfg, rank: int) -> int:
    return rank // (cfg.dp * cfg.cp * cfg.tp)


def run_dry(names=None, configs=None) -> dict:
    from pyfast.plan.memory import predict_memory
    from pyfast.train.config import TrainConfig
    from pyfast.train.dryrun import dry_run
    rows, t_all = [], time.perf_counter()
    for name, kw in DRY + DRY_MESH + DRY_FP16 + DRY_HYBRID if configs is None else configs:
        if names and name not in names:
            continue
        cfg = TrainConfig(**kw)
        t0 = time.perf_counter()
        traced = dry_run(cfg, cfg.ranks, dry_ranks(cfg))
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        pred = predict_memory(*plan_of(cfg), device="meta")
        us = 1e6 * (time.perf_counter() - t1)
        for t in traced:
            p = pred["per_stage"][stage_of(cfg, t["rank"])]
            rows.append({"config": name, "ranks": cfg.ranks, "rank": t["rank"],
                         "stage": stage_of(cfg, t["rank"]), "traced": t["peak_bytes"],
                         "predicted": p, "error": p / t["peak_bytes"] - 1,
                         "traced_kinds": {k: v for k, v in t.items()
                                          if k not in ("rank", "peak_bytes")},
                         "predicted_kinds": pred if p == pred["peak_bytes"] else None,
                         "dry_s": dt, "predict_us": us})
        print(f"{name}: {max(abs(r['error']) for r in rows if r['config'] == name):.1%} "
              f"({dt:.1f} s)", flush=True)
    return {"rows": rows, "dry_run_s": time.perf_counter() - t_all}


def _worker() -> None:
    """One gloo rank of a REAL configuration: the job's second step under MemoryTracker on
    real CPU tensors (dryrun.measure), and the peak RSS growth over that step."""
    import torch
    import torch.distributed as dist

    from pyfast.train.config import TrainConfig
    from pyfast.train.dryrun import measure
    from pyfast.train.job import Job
    spec = json.loads(os.environ["PYFAST_PLAN_MEMORY"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    job = None
    try:
        torch.manual_seed(0)
        job = Job(TrainConfig(**spec["cfg"]), torch.device("cpu"))
        job.train_step(1)
        with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM := VmRSS from here on
            f.write("5")
        rss0 = _status("VmRSS")
        out = measure(job, lambda: job.train_step(2))
        row = {"rank": dist.get_rank(), **out, "rss_growth": _status("VmHWM") - rss0}
        with open(os.path.join(spec["dir"], f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(row, f)
    finally:
        if job is not None:
            job.close()
        dist.destroy_process_group()


def _status(key: str) -> int:
    """Bytes of a /proc/self/status memory line (VmRSS, VmHWM: the peak since clear_refs)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def run_real(names=None, configs=None) -> dict:
    from pyfast import netns
    from pyfast.plan.memory import predict_memory
    from pyfast.train.config import TrainConfig
    rows, t_all = [], time.perf_counter()
    for name, world, kw in REAL if configs is None else configs:
        if names and name not in names:
            continue
        cfg = TrainConfig(**kw, steps=4)
        with tempfile.TemporaryDirectory() as d:
            env = {"PYFAST_PLAN_MEMORY": json.dumps({"cfg": {**kw, "steps": 4}, "dir": d})}
            netns.run_ranks(["-c", "from pyfast.benchmarks.plan_memory import _worker; "
                             "_worker()"], world, env=env, timeout=600,
                            fork=False)  # it measures memory: fresh processes (netns.ranks)
            got = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
        pred = predict_memory(*plan_of(cfg), device="cpu")
        for g in got:
            st = stage_of(cfg, g["rank"])
            p = pred["per_stage"][st]
            rows.append({"config": name, "ranks": world, "rank": g["rank"], "stage": st,
                         "measured": g["peak_bytes"], "rss_growth": g["rss_growth"],
                         "predicted": p, "error": p / g["peak_bytes"] - 1,
                         "measured_kinds": {k: v for k, v in g.items()
                                            if k not in ("rank", "peak_bytes", "rss_growth")}})
        print(f"{name}: {max(abs(r['error']) for r in rows if r['config'] == name):.1%}",
              flush=True)
    return {"rows": rows, "seconds": time.perf_counter() - t_all}


def summary(res: dict) -> str:
    out = []
    for part, tol in (("dry", 0.10), ("real", 0.15)):
        rows = res.get(part, {}).get("rows", [])
        if not rows:
            continue
        worst = {}
        for r in rows:
            worst[r["config"]] = max(worst.get(r["config"], 0.0), abs(r["error"]))
        bad = [c for c, e in worst.items() if e > tol]
        what = "dry-run-traced" if part == "dry" else "measured (CPU allocations)"
        med = sorted(worst.values())[len(worst) // 2]
        out.append(f"predicted vs {what}: {len(worst)} configs, {len(rows)} ranks, max |error| "
                   f"{max(worst.values()):.1%}, median {med:.1%}, {len(bad)} over {tol:.0%}"
                   + (f" ({', '.join(bad)})" if bad else ""))
    if "dry" in res:
        out.append(f"dry runs: {res['dry']['dry_run_s']:.0f} s in all")
    return "\n".join(out)


def table(res: dict):
    from rich.console import Group
    from rich.table import Table
    parts = []
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    for part, col, title in (("dry", "traced", "predicted vs dry run (fp32, meta attention)"),
                             ("real", "measured", "predicted vs real CPU allocations (gloo)")):
        rows = res.get(part, {}).get("rows", [])
        if not rows:
            continue
        t = Table(title=f"plan memory: {title}, peak MiB per rank")
        for c in ("config", "ranks", "rank", "stage", col, "predicted", "error") + \
                (("RSS growth",) if part == "real" else ()):
            t.add_column(c, justify="left" if c == "config" else "right")
        for r in rows:
            t.add_row(r["config"], str(r["ranks"]), str(r["rank"]), str(r["stage"]), mib(r[col]),
                      mib(r["predicted"]), f"{r['error']:+.1%}",
                      *((mib(r["rss_growth"]),) if part == "real" else ()))
        parts.append(t)
    parts.append(f"{summary(res)}\n{res.get('machine', '')}; {res.get('date', '')}")
    return Group(*parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyfast bench plan_memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="dry,real", help="dry, real or both (comma list)")
    p.add_argument("--configs", default="", help="comma list of config names (default: all)")
    p.add_argument("--set", default="all", choices=("all", "base", "mesh", "fp16", "hybrid"),
                   help="dry: every configuration, or one list (DRY, DRY_MESH, DRY_FP16, "
                   "DRY_HYBRID)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    names = set(a.configs.split(",")) if a.configs else None
    res = {"machine": perf.machine(),
           "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if "dry" in a.part:
        res["dry"] = run_dry(names, None if a.set == "all" else
                             {"base": DRY, "mesh": DRY_MESH, "fp16": DRY_FP16,
                              "hybrid": DRY_HYBRID}[a.set])
    if "real" in a.part:
        res["real"] = run_real(names)
    res["summary"] = summary(res)
    return perf.finish(res, table, a.out, width=140)


if __name__ == "__main__":
    raise SystemExit(main())
