"""Step time of a plan. FIRST CUT (the interface; the full model replaces the body): compute
from FLOPs at the cluster's MFU, ring collectives at the group's link, the pipeline bubble.

predict_time(shape, plan, work, cluster) -> {"step_s", "compute_s", "comm_s", "exposed_comm_s",
    "bubble_s", "recompute_s", "codec_s", "tokens_per_s", "steps_factor"}: steps_factor is the
    extra steps to a target loss the compressor costs (1.0 for none).
"""
from __future__ import annotations

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload


def predict_time(shape: ModelShape, plan: Plan, work: Workload, cluster: Cluster) -> dict:
    peak = cluster.gpu.flops_32 if work.precision == "fp32" else cluster.gpu.flops_16
    flops = shape.flops_per_token(work.seq) * work.tokens / plan.ranks
    recompute = flops / 3 if plan.activation_checkpointing else 0.0
    compute = (flops + recompute) / (peak * cluster.mfu)
    lat, bw = cluster.link(plan.tp * plan.cp * plan.dp)
    grad_bytes = 4 * shape.params() / (plan.tp * plan.pp)
    n = plan.dp * plan.cp
    comm = 2 * (n - 1) / n * grad_bytes / bw + 2 * (n - 1) * lat if n > 1 else 0.0
    bubble = compute * (plan.pp - 1) / plan.micro_batches if plan.pp > 1 else 0.0
    step = compute + comm + bubble
    return {"step_s": step, "compute_s": compute, "comm_s": comm, "exposed_comm_s": comm,
            "bubble_s": bubble, "recompute_s": recompute / (peak * cluster.mfu), "codec_s": 0.0,
            "tokens_per_s": work.tokens / step, "steps_factor": 1.0}
