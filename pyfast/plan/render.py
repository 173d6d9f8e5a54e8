"""`pyfast plan`'s text: a plan described, its command, why it ranks where it does, the notes,
and the tables of the ranked and rejected plans (cli.py searches and prints; this words it)."""
from __future__ import annotations

import math
import shlex

from . import shapes
from .search import TIE_BAND, GiB, Result, Scored
from .spec import ModelShape, Workload, gpt_model_flag


def describe(s: Scored) -> str:
    p = s.plan
    parts = [f"dp {p.dp} x cp {p.cp} x tp {p.tp} x pp {p.pp}"]
    if s.diloco:
        d = s.diloco
        parts[0] = (f"DiLoCo {d['replicas']} replicas (H {d['sync_every']}, F {d['fragments']}, "
                    f"tau {d['delay']}, {d['outer_compress']}) of " + parts[0])
    if p.zero:
        parts.append(f"zero {p.zero}" + (f" in groups of {p.shard_group}" if p.shard_group
                                          else ""))
    if p.compress != "none":
        parts.append(p.compress)
    parts.append(f"{p.micro_batches} x {p.micro_batch} seq")
    if p.pp > 1:
        parts.append(p.schedule)
    if p.activation_checkpointing:
        parts.append("recompute")
    if p.lora:
        parts.append(finetune_label(p))
    if p.offload != "none":
        parts.append(f"offload {p.offload}")
    return ", ".join(parts)


def zero_cell(p) -> str:
    """The ZeRO stage, and "/N" when it shards over N ranks of a node (hybrid sharding)."""
    return f"{p.zero}/{p.shard_group}" if p.shard_group else str(p.zero)


def finetune_label(p) -> str:
    """'lora 16, bf16 base' / 'qlora 16, nf4 base sharded'; 'full' without adapters."""
    if not p.lora:
        return "full"
    base = "training-dtype" if p.base_dtype == "none" else p.base_dtype
    return f"{p.finetune} {p.lora}, {base} base" + (" sharded" if p.zero == 3 and
                                                     p.base_placement == "shard" else "") + \
        (f", loss chunks {p.loss_chunks}" if p.loss_chunks else "")


def model_flag(shape: ModelShape, plan) -> str | None:
    """`pyfast train --model` of a plan: the reference GPT's; a LoRA plan (dp only) of a Hugging
    Face shape: hf:DIR (a llama preset: DIR named after its repository, shapes.HF_REPOS)."""
    try:
        return gpt_model_flag(shape)
    except ValueError:
        pass
    if not plan.lora:
        return None
    if shape.name.startswith("hf:"):
        return shape.name.split(" (")[0]
    repo = shapes.HF_REPOS.get(shape.name)
    return f"hf:{repo.split('/')[-1]}" if repo else None


def command(s: Scored, shape: ModelShape, work: Workload, cl) -> str | None:
    """The `pyfast train` command of a plan; None for a model `pyfast train` cannot build.
    Several nodes: torchrun's static rendezvous, run on every node with its own rank."""
    flag = model_flag(shape, s.plan)
    if flag is None:
        return None
    n = s.plan.ranks
    flags = s.plan.train_flags(flag, work)
    if s.diloco:  # R replicas of the plan, one a node: --batch stays the global batch
        d = s.diloco
        n *= d["replicas"]
        flags += ["--diloco", str(d["sync_every"]), "--replicas", str(d["replicas"]),
                  "--fragments", str(d["fragments"]), "--diloco-delay", str(d["delay"]),
                  "--outer-compress", d["outer_compress"]]
    per = min(n, cl.gpus_per_node)
    cmd = shlex.join(["pyfast", "train", *flags, "--nproc", str(per)])
    if n > per:
        cmd += f" --nnodes {math.ceil(n / per)} --node-rank $NODE_RANK " \
               "--rdzv-endpoint $MASTER_ADDR:29500"
    return cmd


def size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:.1f} MiB"


def lost(s: Scored, best: Scored) -> str:
    """The (at most two) parts of the time to target where `s` loses most to `best`."""
    t, b = s.time, best.time
    d = {name: t.get(k, 0) - b.get(k, 0) for k, name in (
        ("compute_s", "compute"), ("exposed_comm_s", "exposed comm"), ("bubble_s", "bubble"),
        ("recompute_s", "recompute"), ("codec_s", "codec"))}
    d["extra steps"] = s.to_target_s - t["step_s"] - (best.to_target_s - b["step_s"])
    worst = sorted(((v, k) for k, v in d.items() if v > 1e-9), reverse=True)[:2]
    return ", ".join(f"{k} +{v:.3g}s" for v, k in worst)


def why(s: Scored, best: Scored) -> str:
    """What the plan's time is made of, and for all but the best, what it loses to the best."""
    t = s.time
    parts = [f"compute {t['compute_s']:.3g}s"]
    for k, name in (("exposed_comm_s", "exposed comm"), ("bubble_s", "bubble"),
                    ("recompute_s", "recompute"), ("codec_s", "codec")):
        if t.get(k, 0) > 1e-3 * t["step_s"]:
            parts.append(f"{name} {t[k]:.3g}s")
    if t.get("host_step_s") is not None:  # an offload plan (offload.py)
        parts.append(f"host step {t['host_step_s']:.3g}s, exposed PCIe "
                     f"{t['exposed_pcie_s']:.3g}s")
    if s.diloco:
        parts.append(f"DiLoCo outer {t['outer_s']:.3g}s a step")
    if t["steps_factor"] != 1.0:
        what = "DiLoCo's loss per token" + (f", {s.plan.compress}" if s.plan.compress != "none"
                                            else "") if s.diloco else s.plan.compress
        parts.append(f"x{t['steps_factor']:.2f} steps ({what})")
    if s is best:
        return "best: " + ", ".join(parts)
    loss = lost(s, best)
    d = s.to_target_s / best.to_target_s - 1
    if d < 0:  # a tie (search.TIE_BAND) ranked #1 first as simpler or smaller
        return (f"{d:.1%} vs #1 (a tie within {TIE_BAND:.0%}: #1 has fewer model-parallel "
                "dimensions or less memory); " + ", ".join(parts))
    return (f"+{d:.1%} vs #1"
            + (f" ({loss})" if loss else " (as fast, more memory)") + "; " + ", ".join(parts))


def notes(shape: ModelShape, cl, best: Scored | None = None) -> list[str]:
    out = []
    flag = model_flag(shape, best.plan) if best is not None else None
    if flag and flag.startswith("hf:"):
        repo = shapes.HF_REPOS.get(shape.name)
        out.append(f"--model {flag}: a local Hugging Face directory"
                   + (f", a copy of {repo} (huggingface-cli download {repo} --local-dir "
                      f"{flag[3:]})" if repo else "")
                   + "; --data: token shards made with its tokenizer (pyfast data), the job "
                   "checks their vocabulary against the model's")
        return out + notes(shape, cl)[1:]
    try:
        gpt_model_flag(shape)
        if shape.vocab != 256:
            out.append(f"planned with a {shape.vocab:,}-token vocabulary: `pyfast train` takes "
                       "its vocabulary from --data (256 bytes by default); pass a tokenized "
                       "--data (uint16 .bin) of that vocabulary for the same model")
    except ValueError as e:
        out.append(f"{e}, so no command is printed; `pyfast plan --params "
                   f"{shape.params():.4g} --layers {shape.layers} --hidden {shape.hidden} --heads "
                   f"{shape.heads} ...` plans the reference GPT of its depth and width, which "
                   "it can")
    if cl.gpu.name == "cpu" and not cl.gpu.measured and not cl.calibration:
        out.append("--gpu cpu is a placeholder (50 GFLOP/s, 2 GB/s): --measure times this "
                   "machine, --calibrate RUNDIR refits from a run")
    return out


def render(res: Result, shape, work, cl, console) -> None:
    from rich.table import Table
    link = f"{cl.intra_bps / 1e9:g} GB/s in a node" + (
        f", {cl.inter_bps * 8 / 1e9:g} Gbit/s between nodes" if cl.nodes > 1 else "")
    console.print(f"[bold]{shape.name}[/]: {shape.params() / 1e9:.3g}B parameters ({shape.arch}, "
                  f"{shape.layers} layers x {shape.hidden}, {shape.heads} heads / "
                  f"{shape.kv_heads} kv, ffn {shape.ffn}, vocab {shape.vocab:,}); "
                  f"{cl.gpus} x {cl.gpu.name} on {cl.nodes} node(s), {link}; --seq {work.seq} "
                  f"--global-batch {work.global_batch} {work.precision}")
    console.print(f"scored {res.memory_scored:,} configurations in {res.seconds:.2f} s: "
                  f"{res.fitting:,} fit, {res.memory_scored - res.time_scored:,} over memory, "
                  f"{res.pruned:,} pruned (a larger micro-batch than one that does not fit); "
                  f"{len(res.mesh_problems)} meshes the job cannot run; {res.ties:,} plans "
                  "left out of the top: they score as one listed (to 0.1%)")
    t = Table(title="plans, best first (time to the target loss = step x compression's extra "
              "steps)")
    ft = any(s.plan.lora for s in res.plans + res.rejected)  # a fine-tune column
    off = bool(res.offload)  # offload plans: the offload, the host's bytes beside the device's
    for c in ("#", "dp x cp x tp x pp", "zero", "compress", "micro-batches x seqs",
              "schedule / cp", "recompute") + ("fine-tune",) * ft + (
              ("offload",) * off + ("device/rank" if off else "memory/rank",) +
              ("host/rank", "host/node") * off + ("step s", "tokens/s", "why")):
        t.add_column(c, justify="left" if c in ("why", "compress", "schedule / cp",
                                                "fine-tune") else "right")
    best = res.plans[0]
    for i, s in enumerate(res.plans, 1):
        p = s.plan
        mesh = f"{p.dp}x{p.cp}x{p.tp}x{p.pp}"
        if s.diloco:
            mesh = f"DiLoCo {s.diloco['replicas']} x {mesh}"
        t.add_row(str(i), mesh, zero_cell(p), p.compress,
                  f"{p.micro_batches}x{p.micro_batch}",
                  " ".join([p.schedule] * (p.pp > 1) + [p.cp_method] * (p.cp > 1)) or "-",
                  "yes" if p.activation_checkpointing else "no",
                  *(finetune_label(p),) * ft, *(p.offload,) * off, size(s.peak),
                  *(size(s.memory.get("host_bytes", 0)),
                    size(s.memory.get("host_bytes", 0) * min(p.ranks, cl.gpus_per_node))) * off,
                  f"{s.time['step_s']:.3g}", f"{s.time['tokens_per_s']:,.0f}", why(s, best))
    console.print(t)
    if res.rejected:
        r = Table(title="rejected (per mesh and ZeRO stage where nothing fits: its smallest "
                  "plan), fastest-if-it-fitted first")
        for c in ("dp x cp x tp x pp", "zero", "compress", "micro-batches x seqs", "recompute") \
                + ("fine-tune",) * ft + ("offload",) * off + ("step s", "reason"):
            r.add_column(c, justify="left" if c in ("reason", "fine-tune") else "right")
        for s in res.rejected:
            p = s.plan
            r.add_row(f"{p.dp}x{p.cp}x{p.tp}x{p.pp}", zero_cell(p), p.compress,
                      f"{p.micro_batches}x{p.micro_batch}",
                      "yes" if p.activation_checkpointing else "no",
                      *(finetune_label(p),) * ft, *(p.offload,) * off,
                      f"{s.time['step_s']:.3g}" if s.time else "-", s.reason)
        console.print(r)
    if res.mesh_problems:
        uniq = list(dict.fromkeys(res.mesh_problems.values()))
        console.print("meshes refused: " + "; ".join(uniq[:5])
                      + (f"; and {len(uniq) - 5} more" if len(uniq) > 5 else ""))
    if res.offload and res.plans[0].plan.offload != "none":
        console.print((f"note: no plan fits the {cl.gpu.memory_bytes / GiB:.1f} GiB of a "
                       f"{cl.gpu.name} alone" if res.offload == "auto" else
                       f"note: --offload {res.offload}") + ": these keep ZeRO's optimizer state (and with "
                      "params, the parameter shards) in host memory, checked against "
                      f"{cl.host_ram_bytes / GiB:,.0f} GiB of host RAM a node (--host-ram); "
                      f"PCIe {cl.gpu.pcie_bps / 1e9:g} GB/s one way, host AdamW at "
                      f"{cl.gpu.host_bps / 1e9:g} GB/s a GPU (hardware.py)")
    for kind, small in res.passed_over:
        console.print(f"note: --finetune auto: no {kind} plan fits"
                      + (f" (its smallest, {describe(small)}, needs {size(small.peak)} a rank)"
                         if small else "") + f"; these are {res.finetune} plans")
    for n in notes(shape, cl, res.plans[0]):
        console.print(f"note: {n}")
    for i, s in enumerate(res.plans, 1):
        if s.diloco:
            dcmd = command(s, shape, work, cl)
            console.print(f"note: #{i} is DiLoCo across the {s.diloco['replicas']} nodes: its "
                          f"{s.diloco['caveat']}" + ("; its command (every node):" if dcmd
                                                      and s is not best else ""))
            if dcmd and s is not best:
                console.print(dcmd, markup=False, highlight=False, soft_wrap=True)
    cmd = command(best, shape, work, cl)
    if cmd:
        console.print("the best plan's command" + (" (on every node, NODE_RANK 0.."
                      f"{cl.nodes - 1}, MASTER_ADDR node 0's address)" if "$NODE_RANK" in cmd
                      else "") + ":")
        console.print(cmd, markup=False, highlight=False, soft_wrap=True)
