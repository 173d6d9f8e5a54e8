"""DiLoCo candidates for `pyfast plan` (docs/diloco.md): when the cluster has several nodes,
one replica per node (`pyfast train --diloco H --replicas R`), each replica the best plan of
one node for its share of the global batch, the replicas synchronized by Streaming DiLoCo over
the inter-node link.

Step time, from timing.py's model: the replica's inner step (predict_time on a one-node
cluster, its small all-reduce inside the node as the job now runs it), plus per fragment
sync (every H / F steps) what the outer all-reduce does not hide behind TAU inner steps: each
rank's 1/(dp x cp) slice of the fragment (its parameters / F), int4 with one fp32 scale per
512 elements, all-gathered between the R replicas over the inter-node link (DiLoCo's
allgather algorithm: each rank codes once, decodes R), the slices all-gathered back inside
the node, the outer step's passes over the fragment, and the replicas' meeting (one small
all-reduce over every rank before each send). TAU is the smallest delay that hides the
transfer (at most H / F - 1).

The caveat, measured (docs/diloco.md, `pyfast bench diloco`, gpt-tiny): Streaming DiLoCo
(H = 40, F = 4, TAU = 2, int4) has a validation loss 3.4% above data parallel's at equal
tokens and needs 280 steps to data parallel bf16's loss at 200 (1.4x the tokens); gpt-small's
200-step run needs 1.7-2.3x the steps to dp's losses at its steps 100-180 and more than 3x to
its final one (+8.1% at equal tokens: the gap widens at a constant learning rate). The
candidate's time to target multiplies its step by 2.0 (the middle of gpt-small's range), so it
ranks first only where the link makes data parallel more than 2x slower.
"""
from __future__ import annotations

from dataclasses import replace

from .hardware import Cluster
from .spec import ModelShape, Workload
from .timing import DENSE_BYTES, Link, _codec

H, F = 40, 4                 # the measured Streaming configuration (docs/diloco.md)
OUTER_COMPRESS = "int4"      # within 0.02% of fp32 outer gradients there, 8x fewer bytes
STEPS_FACTOR = 2.0           # steps to dp bf16's loss: gpt-tiny 1.4x, gpt-small 1.7-2.3x (N=200)
CAVEAT = ("loss per token is worse: Streaming DiLoCo (H 40, F 4, tau 2, int4) measured +3.4% "
          "validation loss at equal tokens on gpt-tiny (+8.1% on gpt-small at 200 steps) and "
          "1.4x (gpt-tiny) to 1.7-2.3x (gpt-small, more than 3x to its final loss at 200 "
          "steps) the steps to data parallel bf16's loss (docs/diloco.md); ranked with 2x")
SMALL_BYTES = 16.0 * 2       # the meeting: loss, bytes and 3 values a replica, fp64 (R = 2)


def local_params(shape: ModelShape, plan) -> float:
    """Elements of one rank's parameters (its tp shard of its pipeline stage, the largest)."""
    from .timing import _modules
    return max(sum(n for _, ps in _modules(shape, plan, st) for n, _ in ps)
               for st in range(plan.pp))


def outer(shape: ModelShape, plan, inner_step_s: float, cluster: Cluster, replicas: int) -> dict:
    """The outer all-reduce's seconds and what a step pays for it (module doc)."""
    n = local_params(shape, plan) / F            # a fragment on this rank
    share = plan.dp * plan.cp                    # ranks of a replica holding the same ones
    piece = n / share
    link = Link(cluster, cluster.gpus, replicas)  # between nodes: R replicas, one rank each
    enc, dec = _codec(OUTER_COMPRESS, piece, cluster)
    wire = link.seconds("small", 16.0) + link.seconds(
        "all_gather", DENSE_BYTES[OUTER_COMPRESS] * piece)
    transfer = wire + enc + replicas * dec
    gather = Link(cluster, plan.ranks, share).seconds("all_gather", 4.0 * piece) if share > 1 \
        else 0.0
    apply_s = 6 * 4.0 * n / cluster.gpu.hbm_bps  # pseudo-gradient, momentum, global, merge
    meet = Link(cluster, cluster.gpus, cluster.gpus).seconds("small", SMALL_BYTES)
    per = H // F
    tau = next((t for t in range(per) if transfer <= t * inner_step_s), per - 1)
    exposed = max(0.0, transfer - tau * inner_step_s) + gather + apply_s + meet
    return {"transfer_s": transfer, "delay": tau, "exposed_s": exposed,
            "per_step_s": exposed / per, "bytes": DENSE_BYTES[OUTER_COMPRESS] * piece}


def candidate(shape: ModelShape, work: Workload, cluster: Cluster, search,
              cross_node: bool = False):
    """The DiLoCo candidate (a search.Scored with .diloco set), or None: one node, a global
    batch the replicas cannot split, or nothing fits a node. `search` is search.search, passed
    in by it (this module sits below search.py, which calls it: no import cycle)."""
    R = cluster.nodes
    if R < 2 or work.global_batch % R:
        return None
    node = replace(cluster, gpus=cluster.gpus_per_node)
    best = search(shape, replace(work, global_batch=work.global_batch // R), node, top=1,
                  cross_node=cross_node, rejected=0)
    if not best.plans:
        return None
    plan = best.plans[0].plan
    mem = dict(best.plans[0].memory)
    n = local_params(shape, plan)
    # global parameters and outer momentum (fp32), the fragment's send buffer, the int4
    # error-feedback residual of this rank's slices
    mem["peak_bytes"] += int(4.0 * n * (2 + 1 / F + 1 / (plan.dp * plan.cp)))
    if mem["peak_bytes"] > cluster.gpu.memory_bytes:
        return None
    t = dict(best.plans[0].time)
    o = outer(shape, plan, t["step_s"], cluster, R)
    t["step_s"] += o["per_step_s"]
    t["exposed_comm_s"] += o["per_step_s"]
    t["comm_s"] += (o["transfer_s"] + o["exposed_s"]) / (H // F)
    t["tokens_per_s"] = work.tokens / t["step_s"]
    t["steps_factor"] *= STEPS_FACTOR
    t["outer_s"] = o["per_step_s"]
    s = replace(best.plans[0], memory=mem, time=t)  # a Scored: the node's plan, re-timed
    s.diloco = {"replicas": R, "sync_every": H, "fragments": F, "delay": o["delay"],
                "outer_compress": OUTER_COMPRESS, "outer_transfer_s": o["transfer_s"],
                "outer_bytes_per_rank": o["bytes"], "steps_factor": STEPS_FACTOR,
                "caveat": CAVEAT}
    return s
