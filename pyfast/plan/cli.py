"""`pyfast plan`: the ranked plans for a model on a cluster, why each ranks where it does, the
rejected ones with the reason, and the `pyfast train` command of the best (--json: as data)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from . import cli_scale
from . import cluster as clusters
from . import shapes
from .hardware import GPUS
from .memory import predict_memory
from .finetune import DEFAULT_RANK, FINETUNES
from .render import (command, describe, finetune_label, lost, model_flag, notes,  # noqa: F401
                     size, why, zero_cell)
from .search import TIE_BAND, GiB, Result, Scored, search  # noqa: F401
from .spec import ModelShape, Workload, gpt_model_flag

PLAN_KEYS = ("dp", "cp", "tp", "pp", "zero", "shard_group", "compress", "micro_batch",
             "micro_batches", "schedule", "activation_checkpointing")
VERIFY_MAX_RANKS = 4   # dry-run ranks per verified plan (the first roles and the last)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pyfast plan", description=__doc__.split("\n\n")[0],
        epilog=shapes.PARAMS_RULE + ". Cluster file keys: gpus, gpus_per_node, gpu (a name) or "
        "a [gpu] table (base, memory_gib, flops_16, flops_32, hbm or hbm_bps, intra_bw), "
        "intra_bw, inter_bw, intra_latency_us, inter_latency_us, mfu, price, spot_discount (also "
        "in [gpu]) (docs/plan.md).")
    g = p.add_argument_group("model (one of --model, --params; the rest override its fields)")
    g.add_argument("--model", help=f"a preset ({', '.join(shapes.PRESETS)}) or hf:DIR (a "
                   "Hugging Face config.json)")
    g.add_argument("--params", type=float, help="a parameter count, e.g. 70e9 (the rule below)")
    for k in shapes.OVERRIDES:
        g.add_argument("--" + k.replace("_", "-"), type=int)
    g = p.add_argument_group("cluster (flags override --cluster FILE)")
    g.add_argument("--gpus", type=int, help="GPUs in all")
    g.add_argument("--gpus-per-node", type=int, help="default 8 (or --gpus when fewer)")
    g.add_argument("--gpu", help=f"{', '.join(GPUS)} (default h100)")
    g.add_argument("--intra-bw", help="one way per GPU inside a node, e.g. 450GB/s (default: "
                   "the GPU's NVLink/PCIe)")
    g.add_argument("--inter-bw", help=f"one way per GPU between nodes, e.g. 400gbit, 10gbit "
                   f"(default {clusters.DEFAULT_INTER})")
    g.add_argument("--cluster", metavar="FILE.toml", help="the cluster as a TOML file")
    g.add_argument("--host-ram", metavar="SIZE", help="host RAM per node, e.g. 256GB, 2TB "
                   "(default: the GPU type's usual host, pyfast/plan/hardware.py)")
    g.add_argument("--allow-cross-node-tp", action="store_true",
                   help="let tp and cp groups span nodes (default: inside one node)")
    g.add_argument("--measure", nargs="?", const="loopback", metavar="LINK",
                   help="time this machine's compute and its link (loopback, or an emulated "
                   "rate such as 1gbit) instead of the table's numbers")
    g.add_argument("--calibrate", metavar="RUNDIR", help="refit compute and communication from "
                   "a `pyfast train` run's metrics.jsonl")
    g = p.add_argument_group("workload and output")
    g.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    g.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer "
                   "step (= dp x micro_batch x micro_batches)")
    g.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    g.add_argument("--finetune", default="full", choices=FINETUNES,
                   help="full (every weight trains; the default), lora (rank-R adapters on a "
                   "bf16 base), qlora (adapters on an nf4 or int8 base), auto (full if a "
                   "plan fits, else lora, else qlora); docs/plan.md \"Fine-tuning\"")
    g.add_argument("--lora-rank", type=int, metavar="R",
                   help=f"the adapters' rank for lora/qlora/auto (default {DEFAULT_RANK})")
    g.add_argument("--offload", default="auto", choices=("auto", "none", "optimizer", "params"),
                   help="auto (the default): when no plan fits on the GPUs alone, plan ZeRO "
                   "with --offload optimizer|params (host RAM, PCIe); none: never; optimizer "
                   "or params: only plans with that offload (to compare)")
    g.add_argument("--top", type=int, default=10, help="plans to show (default 10)")
    g.add_argument("--verify", action="store_true", help="dry-run the top plans (up to 3) and "
                   "print predicted vs traced peak memory per rank")
    g.add_argument("--json", action="store_true", help="print {\"plans\": [...], \"rejected\": "
                   "[...]} instead of the tables")
    cli_scale.add_flags(p)
    return p


def inputs(ns) -> tuple[ModelShape, Workload, object]:
    """Shape, workload and cluster from the flags (measured/refit if asked); ValueError."""
    shape = shapes.resolve(ns.model, ns.params, **{k: getattr(ns, k) for k in shapes.OVERRIDES})
    for flag, v in (("--seq", ns.seq), ("--global-batch", ns.global_batch), ("--top", ns.top)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if ns.lora_rank is not None:
        if ns.lora_rank < 1:
            raise ValueError(f"--lora-rank must be >= 1 (the adapters' rank), got {ns.lora_rank}")
        if ns.finetune == "full":
            raise ValueError(f"--lora-rank {ns.lora_rank} with --finetune full: a full "
                             "fine-tune has no adapters (--finetune lora, qlora or auto)")
    work = Workload(ns.seq, ns.global_batch, ns.precision)
    cl = clusters.build(ns.gpus, ns.gpus_per_node, ns.gpu, ns.intra_bw, ns.inter_bw, ns.cluster,
                        ns.host_ram)
    if ns.measure:
        from .calibrate import measure
        cl = measure(shape, work, cl, link=ns.measure)
    if ns.calibrate:
        from .calibrate import refit
        cl = refit(cl, ns.calibrate)
    return shape, work, cl


def nothing_fits(res: Result, shape: ModelShape, work: Workload, cl) -> str:
    """The error when no plan is left: no mesh the job can run, or none fits in memory."""
    where = f"{cl.gpus} x {cl.gpu.name}"
    if res.smallest is None:
        why = list(dict.fromkeys(res.mesh_problems.values()))
        more = f"; and {len(why) - 4} more" if len(why) > 4 else ""
        lora = "" if res.finetune == "full" else \
            f" (--finetune {res.finetune}: dp-only meshes, tp = cp = pp = 1)"
        return (f"no dp x cp x tp x pp of {where} can run {shape.name}{lora} with --seq "
                f"{work.seq} --global-batch {work.global_batch}: {'; '.join(why[:4])}{more}")
    s, cap = res.smallest, cl.gpu.memory_bytes
    if res.host_short is not None:  # offload plans fit the GPUs, but not the host
        h = res.host_short
        return (f"nothing fits: offload plans fit the {cap / GiB:.1f} GiB of a {cl.gpu.name} "
                f"but not the host; the one needing the least host RAM ({describe(h)}) "
                f"needs {h.reason.split(': ', 1)[1]}; give the --host-ram your nodes have, or "
                "more GPUs")
    bigger = [n for n, g in GPUS.items() if g.memory_bytes > s.peak and n != "cpu"]
    return (f"nothing fits: the smallest plan ({describe(s)}) needs {s.peak / GiB:.1f} GiB a "
            f"rank on {s.memory['where']}, {s.peak / cap:.1f}x the {cap / GiB:.1f} GiB of one "
            f"{cl.gpu.name} (of {res.memory_scored:,} plans scored: every ZeRO stage, split "
            "and recompute the job can run); try more GPUs"
            + (f", a GPU with more memory (--gpu {', '.join(bigger)})" if bigger else "")
            + (", --finetune lora or qlora (adapters on a frozen base)"
               if s.plan.finetune == "full" and len(res.passed_over) < 2 else "")
            + ", or a shorter --seq / smaller --global-batch")


def row(s: Scored, shape, work, cl, rejected: bool = False) -> dict:
    d = {k: getattr(s.plan, k) for k in PLAN_KEYS}
    if s.plan.lora:  # (a full plan's keys stay as they were)
        d.update(finetune=s.plan.finetune, lora=s.plan.lora, base_dtype=s.plan.base_dtype,
                 base_placement=s.plan.base_placement, loss_chunks=s.plan.loss_chunks,
                 adapter_params=s.memory.get("adapter_params"),
                 base_bytes=s.memory.get("base_bytes"))
    d["memory_bytes_per_rank"] = int(s.peak)  # the device's
    if s.plan.offload != "none":  # (a plan without offload keeps the keys it had)
        d.update(offload=s.plan.offload, prefetch=s.plan.prefetch,
                 host_bytes_per_rank=s.memory["host_bytes"],
                 host_bytes_per_node=s.memory["host_bytes"] * min(s.plan.ranks,
                                                                  cl.gpus_per_node))
    d["step_s"] = s.time["step_s"] if s.time else None
    d["tokens_per_s"] = s.time["tokens_per_s"] if s.time else None
    d["command"] = None if rejected else command(s, shape, work, cl)
    if rejected:
        d["reason"] = s.reason
    if s.diloco:  # the plan's keys describe one replica; world = replicas x its ranks
        d["replicas"] = s.diloco["replicas"]
        d["diloco"] = dict(s.diloco)
    return d


def verify(res: Result, shape: ModelShape, work: Workload, console, n: int = 3) -> list[dict]:
    """Dry-run the top `n` plans at the workload's precision (fp32, or bf16 / fp16 under the dry
    run's MetaAutocast) and compare each one's traced per-rank peak with the prediction for the
    same plan and the dry run's vocabulary (the data's: 256 bytes)."""
    from pyfast.train.config import from_args
    from pyfast.train.config import parser as train_parser
    from pyfast.train.dryrun import dry_run, roles
    try:
        flag = gpt_model_flag(shape)
    except ValueError as e:
        console.print(f"--verify: {e}: nothing to dry-run")
        return []
    dry_shape = replace(shape, vocab=256)
    out = []
    for s in res.plans[:n]:
        cfg = from_args(train_parser().parse_args(s.plan.train_flags(flag, work)))
        ranks = roles(cfg)
        if len(ranks) > VERIFY_MAX_RANKS:
            ranks = ranks[:VERIFY_MAX_RANKS - 1] + ranks[-1:]
        try:
            traced = max(r["peak_bytes"] for r in dry_run(cfg, cfg.ranks, ranks))
        except Exception as e:  # noqa: BLE001 -- a LoRA plan the dry run cannot trace yet
            if not s.plan.lora:
                raise
            console.print(f"--verify {describe(s)}: the dry run cannot trace it yet "
                          f"({type(e).__name__}: {str(e).splitlines()[-1][:160]}); `pyfast "
                          "bench plan_finetune` lists what it checks and what is pending")
            continue
        # as the dry run runs it: on meta tensors (math attention, single-tensor AdamW)
        pred = predict_memory(dry_shape, s.plan, work, "meta")["peak_bytes"]
        out.append({"plan": describe(s), "predicted_bytes": pred, "traced_bytes": traced,
                    "ranks": ranks, "error": pred / traced - 1})
        console.print(f"--verify {describe(s)} ({work.precision}, vocab 256, ranks {ranks}): predicted "
                      f"{pred / 2**20:,.1f} MiB, traced {traced / 2**20:,.1f} MiB "
                      f"({pred / traced - 1:+.1%})")
    return out


def plan_finetune(shape: ModelShape, work: Workload, cl, ns) -> Result:
    """search() for --finetune; auto: full, then lora, then qlora, the first with a plan that
    fits (the most faithful update that fits; within a kind, the fastest), on the GPUs alone
    first and, --offload auto, then with host offload (a last resort: any kind that fits
    without it wins). Nothing fits at all: the last kind's result (its smallest plan is the
    smallest of any)."""
    kinds = ("full", "lora", "qlora") if ns.finetune == "auto" else (ns.finetune,)
    offloads = ("none", "auto") if ns.offload == "auto" and len(kinds) > 1 else (ns.offload,)
    rank = ns.lora_rank or DEFAULT_RANK
    passed, scored = [], []
    for off in offloads:
        for kind in kinds:
            res = search(shape, work, cl, ns.top, ns.allow_cross_node_tp, diloco=True,
                         finetune=kind, lora_rank=rank, offload=off)
            res.passed_over = list(passed)
            if res.plans:
                return res
            if off == offloads[0]:
                passed.append((kind, res.smallest))
            if res.smallest is not None:
                scored.append(res)
    # nothing fits: the last kind that had plans to score (a LoRA kind may have no mesh)
    res = scored[-1] if scored else res
    res.passed_over = passed
    return res


def main(argv=None) -> int:
    ns = parser().parse_args(argv)
    if ns.scaling:  # one plan search a GPU count (cli_scale.py)
        return cli_scale.scaling_main(ns, inputs, plan_finetune, nothing_fits, row)
    try:
        cli_scale.check_cost(ns)
        shape, work, cl = inputs(ns)
        cli_scale.check_cost(ns, cl)
        res = plan_finetune(shape, work, cl, ns)
        if not res.plans:
            raise ValueError(nothing_fits(res, shape, work, cl))
    except (ValueError, FileNotFoundError) as e:
        print(f"pyfast plan: error: {e}", file=sys.stderr)
        return 2
    from rich.console import Console
    console = Console(stderr=ns.json, width=200)
    if ns.json:
        print(json.dumps({"plans": cli_scale.priced_rows(ns, res.plans, shape, work, cl, row),
                          "rejected": [row(s, shape, work, cl, True) for s in res.rejected]}))
    else:
        from .render import render
        render(res, shape, work, cl, console)
        cli_scale.print_cost(ns, res.plans, work, cl, console)
    if ns.verify:
        verify(res, shape, work, console)
    return 0
