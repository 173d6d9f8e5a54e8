"""`pyfast plan --cluster FILE.toml` on a mixed cluster ([[nodes]] of several GPU types): the
plans with their even and uneven predicted steps side by side, the split, the per-type memory,
the commands (--json: as data). cli.py hands over here; mixed.py searches."""
from __future__ import annotations

import shlex

from .mixed import MixedResult, MixedScored
from .nodes import MixedCluster
from .render import describe, model_flag, size, zero_cell
from .spec import ModelShape, Workload

PLAN_KEYS = ("dp", "cp", "tp", "pp", "zero", "shard_group", "compress", "micro_batch",
             "micro_batches", "schedule", "activation_checkpointing")


def train_flags(s: MixedScored, shape: ModelShape, work: Workload) -> list[str] | None:
    """The `pyfast train` flags of a mixed plan (the split's included); None for a model the
    job cannot build."""
    flag = model_flag(shape, s.plan)
    return None if flag is None else s.plan.train_flags(flag, work) + s.flags()


def commands(s: MixedScored, shape: ModelShape, work: Workload, mc: MixedCluster
             ) -> list[str]:
    """The command(s) that launch a plan: one `pyfast train` run on every node when the
    groups' nodes hold as many GPUs each (torchrun's static rendezvous, NODE_RANK 0..N-1 in
    the file's order); else one torchrun line per group (`pyfast train --nproc` takes one
    size for every node; torchrun numbers ranks node by node with each node's own count)."""
    flags = train_flags(s, shape, work)
    if flags is None:
        return []
    sizes = {g.gpus_per_node for g in mc.groups}
    nodes = mc.nodes
    if len(sizes) == 1:
        per = sizes.pop()
        cmd = shlex.join(["pyfast", "train", *flags, "--nproc", str(per)])
        if nodes > 1:
            cmd += f" --nnodes {nodes} --node-rank $NODE_RANK --rdzv-endpoint $MASTER_ADDR:29500"
        return [cmd]
    out, first = [], 0
    for g in mc.groups:
        ranks = f"{first}" if g.count == 1 else f"{first}..{first + g.count - 1}"
        out.append(f"# {g.name} nodes (NODE_RANK {ranks}):\ntorchrun --nnodes {nodes} "
                   f"--nproc-per-node {g.gpus_per_node} --node-rank $NODE_RANK "
                   f"--rdzv-endpoint $MASTER_ADDR:29500 -m pyfast train {shlex.join(flags)}")
        first += g.count
    return out


def row(s: MixedScored, shape, work, mc: MixedCluster, rejected: bool = False) -> dict:
    d = {k: getattr(s.plan, k) for k in PLAN_KEYS}
    b = s.best

    def part(t):
        return None if t is None else {"step_s": t["step_s"], "tokens_per_s": t["tokens_per_s"],
                                       "split": t["split"], "per_type_step_s": t["per_type"],
                                       "slowest": t["slowest"],
                                       "memory_bytes_per_rank": t["memory"]}
    d.update(memory_bytes_per_rank=b["memory"], step_s=b["step_s"],
             tokens_per_s=b["tokens_per_s"], batch_split=b["split"],
             uneven=b is s.uneven, even=part(s.even), uneven_split=part(s.uneven),
             gain=s.gain, pp_balance=b.get("pp_balance"), stage_layers=b.get("layers"))
    d["command"] = None if rejected else (commands(s, shape, work, mc) or [None])[0]
    if rejected:
        d["reason"] = s.reason
    return d


def as_json(res: MixedResult, shape, work, mc: MixedCluster) -> dict:
    return {"cluster": {"groups": [{"name": g.name, "count": g.count,
                                    "gpus_per_node": g.gpus_per_node, "gpu": g.cluster.gpu.name,
                                    "memory_bytes": g.cluster.gpu.memory_bytes}
                                   for g in mc.groups],
                        "inter_bps": mc.inter_bps},
            "plans": [row(s, shape, work, mc) for s in res.plans],
            "rejected": [row(s, shape, work, mc, True) for s in res.rejected]}


def _split(t: dict | None) -> str:
    if not t or not t["split"]:
        return "-"
    sp = t["split"]
    return ",".join(map(str, sp)) if len(sp) <= 8 else f"{sp[0]},...,{sp[-1]} ({len(sp)})"


def render(res: MixedResult, shape, work, mc: MixedCluster, console) -> None:
    from rich.table import Table
    console.print(f"[bold]{shape.name}[/]: {shape.params() / 1e9:.3g}B parameters; mixed "
                  f"cluster {mc.label()} ({mc.gpus} GPUs, {mc.inter_bps * 8 / 1e9:g} Gbit/s "
                  f"between groups); --seq {work.seq} --global-batch {work.global_batch} "
                  f"{work.precision}")
    console.print(f"scored {res.scored:,} configurations in {res.seconds:.2f} s: "
                  f"{res.fitting:,} fit on every GPU type; {len(res.mesh_problems)} meshes "
                  "refused (the job cannot run them, or a tp x cp group or pipeline stage "
                  "would span GPU types)")
    t = Table(title="plans, best first: each priced with the batch split evenly (the slowest "
              "replica sets the pace) and by speed (--batch-split)")
    names = [g.name for g in mc.groups]
    names = list(dict.fromkeys(names))
    for c in ("#", "dp x cp x tp x pp", "zero", "compress", "micro-batches x seqs",
              "recompute", *(f"mem {n}" for n in names), "even step s", "split step s",
              "gain", "batch split", "tokens/s", "why"):
        t.add_column(c, justify="left" if c in ("why", "compress", "batch split") else "right")
    for i, s in enumerate(res.plans, 1):
        p, b = s.plan, s.best
        t.add_row(str(i), f"{p.dp}x{p.cp}x{p.tp}x{p.pp}", zero_cell(p), p.compress,
                  f"{p.micro_batches}x{p.micro_batch}",
                  "yes" if p.activation_checkpointing else "no",
                  *(size(b["memory"].get(n, 0)) for n in names),
                  f"{s.even['step_s']:.3g}",
                  f"{s.uneven['step_s']:.3g}" if s.uneven else "-",
                  f"{s.gain:.2f}x" if s.uneven else "-", _split(b) if b is s.uneven else "even",
                  f"{b['tokens_per_s']:,.0f}", f"slowest {b['slowest']}; {b['why']}")
    console.print(t)
    if res.rejected:
        r = Table(title="rejected (per mesh and ZeRO stage where nothing fits every type)")
        for c in ("dp x cp x tp x pp", "zero", "compress", "micro-batches x seqs", "reason"):
            r.add_column(c, justify="left" if c == "reason" else "right")
        for s in res.rejected:
            p = s.plan
            r.add_row(f"{p.dp}x{p.cp}x{p.tp}x{p.pp}", zero_cell(p), p.compress,
                      f"{p.micro_batches}x{p.micro_batch}", s.reason)
        console.print(r)
    best = res.plans[0]
    if best.uneven:
        u, e = best.uneven, best.even
        console.print(f"note: #1 ({describe(best)}) splits the batch "
                      f"{','.join(map(str, u['split']))} by speed: {u['step_s']:.3g} s a step "
                      f"against {e['step_s']:.3g} s split evenly ({e['slowest']} sets the pace): "
                      f"{e['step_s'] / u['step_s']:.2f}x" + (
                          "; the even split is as fast: kept" if best.best is e else ""))
    cmds = commands(best, shape, work, mc)
    if cmds:
        console.print("the best plan's command" + (" (on every node, NODE_RANK 0.."
                      f"{mc.nodes - 1} in the file's group order, MASTER_ADDR node 0's address)"
                      if mc.nodes > 1 else "") + ":")
        for c in cmds:
            console.print(c, markup=False, highlight=False, soft_wrap=True)
    else:
        console.print(f"note: {shape.name} is not pyfast's reference GPT: no command")
