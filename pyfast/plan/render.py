"""`pyfast plan`'s tables: the ranked plans, the rejected ones, and the notes and command below
them (cli.py builds the data; this prints it with rich)."""
from __future__ import annotations

from .cli import GiB, command, describe, finetune_label, notes, size, why, zero_cell
from .search import Result


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
