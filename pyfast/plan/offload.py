"""Offload plans (`pyfast train --offload optimizer|params`, pyfast.parallel.zero's host offload):
what moves to the host, what the device keeps to stage the transfers, and the time the host
and the PCIe link add to a step. Pure arithmetic, no torch. docs/plan.md "Offload".

Memory (memory.py and finetune.py call these; N = the ZeRO shard group, P this rank's trainable
parameters, `shard` its ZeRO shard, ceil-rounded per tensor):
- optimizer (ZeRO 1-3): the host holds the fp32 master shard (4 shard: a copy, where stages 1/2
  without offload step on a view of the device parameter), the reduced gradient shards (4
  shard) and AdamW's two moments and step counts (8 shard + 4 a tensor); the device keeps its
  parameters (stages 1/2: all, fp32 as the job holds them; stage 3: its shard, the gather
  source refreshed from the master) and its gradients as without offload until the end of
  backward (pyfast.parallel.zero.offload_step copies every unit's reduced shard to the host
  then, in ZeroModel._finish: the dry run traces them on the device). The device's optimizer
  step is gone: after it only the all-gather's units of stages 1/2 (as without offload).
- params (ZeRO 3): optimizer, plus no device shard at all: the master is the gather source, and
  a LoRA base sharded (--base-placement shard) lives on the host in its stored format; the
  device keeps `prefetch + 1` gathered units (the running one and those fetched ahead) and the
  `prefetch` host shards copied ahead of their all-gather.
The host's step adds its AdamW's temporaries (HOST_ADAMW_TEMPS: none for pyfast.optim.AdamW); one rank's host bytes times
the ranks of a node is what --host-ram must hold.

Time (offload_time, on top of the plan's time without offload, whose device optimizer step it
removes): the host step, HOST_ADAMW_BYTES a parameter over the GPU's share of the host memory
bandwidth (hardware.py host_bps), all exposed (the step waits for it; the delayed update that
would hide it is not planned); the gradient shards device->host and the updated shards
host->device over the GPU's PCIe link (pcie_bps, one way; the two directions are separate),
and for params offload every unit's shard host->device in each micro-batch's forward and
backward (and the sharded base's stored bytes). Overlap: a transfer streams behind the compute
of the layers it overlaps, in order, so a phase's transfers of total X behind compute C expose
max(X / units, X - C): at least the one unit nothing runs beside (the first fetched, or the
last gradient out), at most what compute cannot cover. What overlaps what: ZeRO 2/3's gradient
shards the last micro-batch's backward; stage 3's refreshed shards the next forward; params
offload's shards their own phase (forward, backward); stage 1's gradients (reduced at the step)
and stages 1/2's updated shards (the all-gather waits for them) nothing.
"""
from __future__ import annotations

OFFLOADS = ("none", "optimizer", "params")
F32 = 4
# bytes a parameter a CPU AdamW streams: reads parameter, gradient and two moments (4 x 4 fp32),
# writes parameter and moments (3 x 4): 28 (DeepSpeed's CPU Adam and pyfast.optim.AdamW alike)
HOST_ADAMW_BYTES = 28
# temporaries of the host step, in largest-shard-tensors: the job's host AdamW is
# pyfast.optim.AdamW (pyfast.train.offload.optim_cls), an in-place kernel that keeps none; torch's
# single-tensor CPU AdamW kept 3 at once (the dry run: gpt-7b-shaped ZeRO 2 dp 2, 384 MiB over
# the state, 3 x the 4096 x 16384 fc's half)
HOST_ADAMW_TEMPS = 0


def check(plan, n: int) -> None:
    """What offload runs on (zero()'s rules): ValueError naming the problem."""
    if plan.offload not in OFFLOADS:
        raise ValueError(f"--offload must be one of {', '.join(OFFLOADS)}, got {plan.offload!r}")
    if plan.offload == "none":
        return
    if not plan.zero:
        raise ValueError(f"--offload {plan.offload} offloads ZeRO's shards: it needs --zero 1, 2 "
                         f"or 3 (one rank or more; got zero {plan.zero} on {n} ranks)")
    if plan.offload == "params" and plan.zero != 3:
        raise ValueError(f"--offload params needs --zero 3 (parameter shards), got --zero "
                         f"{plan.zero}; --offload optimizer runs on stages 1-3")
    if plan.prefetch < 1:
        raise ValueError(f"--offload-prefetch must be >= 1, got {plan.prefetch}")


def host_state(master: float, gradients: float, optimizer: float, largest: float,
               base: float = 0.0) -> dict:
    """One rank's host bytes by kind at the step's peak; largest: the bytes of the largest
    parameter shard, of which the host AdamW keeps HOST_ADAMW_TEMPS at once."""
    return {"master": int(master), "gradients": int(gradients), "optimizer": int(optimizer),
            "base": int(base), "temporaries": int(HOST_ADAMW_TEMPS * largest)}


def params_extra(plan, unit: float, n: int) -> float:
    """Params offload's device bytes beyond the 2 gathered units stage 3 holds anyway: the units
    fetched beyond one ahead, and the `prefetch` host shards copied ahead (a unit / n each)."""
    if plan.offload != "params":
        return 0.0
    return (plan.prefetch - 1) * unit + plan.prefetch * unit / n


def add(row: dict, host: dict) -> dict:
    """The memory row with the host's bytes: "host" by kind, "host_bytes" a rank."""
    row["host"] = host
    row["host_bytes"] = sum(host.values())
    row["offload"] = True
    return row


def exposed(x: float, units: int, compute: float) -> float:
    """Transfers of x seconds streamed in `units` pieces behind `compute` seconds (module doc)."""
    return max(x / max(units, 1), x - compute) if x > 0 else 0.0


def offload_time(shape, plan, work, cluster, t: dict, n_opt: float, base_bytes: float = 0.0,
                 units: int | None = None, bwd_per_fwd: float = 2.0) -> dict:
    """The plan's time `t` (predicted without offload) with the host's and the link's seconds
    (module doc). n_opt: the parameters this rank's host steps; base_bytes: a sharded frozen
    base's stored bytes on this rank (params offload); units: ZeRO 3's per micro-batch;
    bwd_per_fwd: backward's compute over forward's (timing_compute.BWD_PER_FWD)."""
    g = cluster.gpu
    m, z = plan.micro_batches, plan.zero
    units = units or shape.layers + 2
    host_s = HOST_ADAMW_BYTES * n_opt / g.host_bps
    shard_s = F32 * n_opt / g.pcie_bps          # one way: all this rank's shards
    fb = max(0.0, t["compute_s"] - t["recompute_s"]) / max(m, 1)  # a micro-batch's f + b
    fwd = fb / (1 + bwd_per_fwd)
    bwd = fb - fwd
    piped = plan.pp > 1
    d2h = exposed(shard_s, units, bwd) if z >= 2 and not piped else shard_s
    if plan.offload == "params":  # no device shard: nothing to refresh; every phase fetches
        h2d = 0.0
        fetch = shard_s + base_bytes / g.pcie_bps
        fetch_exp = m * (exposed(fetch, units, fwd) + exposed(fetch, units, bwd))
    else:
        h2d = exposed(shard_s, units, fwd) if z == 3 else shard_s
        fetch = fetch_exp = 0.0
    added = host_s + d2h + h2d + fetch_exp
    out = dict(t)
    out["step_s"] = t["step_s"] - t["optimizer_s"] + added
    out["tokens_per_s"] = work.tokens / out["step_s"]
    # gradients down, and the updated shards up (params: none, the master is the source)
    pcie = shard_s + (0.0 if plan.offload == "params" else shard_s) + 2 * m * fetch
    out.update(host_step_s=host_s, pcie_s=pcie,
               exposed_pcie_s=d2h + h2d + fetch_exp, optimizer_s=host_s)
    out["exposed_comm_s"] = t["exposed_comm_s"] + d2h + h2d + fetch_exp
    why = [w for w in (t.get("why") or "").split(", ") if w and not w.startswith("optimizer")]
    why.append(f"host step {100 * host_s / out['step_s']:.0f}%, exposed PCIe "
               f"{100 * (d2h + h2d + fetch_exp) / out['step_s']:.0f}%")
    out["why"] = ", ".join(why)
    return out
