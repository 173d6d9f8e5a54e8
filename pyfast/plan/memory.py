"""Memory per rank of a plan. FIRST CUT (the interface; the full model replaces the body):
ZeRO's 16 bytes per parameter split by stage, Korthikanti et al.'s activations.

predict_memory(shape, plan, work) -> {"parameters", "gradients", "optimizer", "activations",
    "comm_buffers", "feedback", "peak_bytes", "where"}: bytes on the rank that needs the most
    ("where" names it, e.g. "pp stage 0").
"""
from __future__ import annotations

from .spec import ModelShape, Plan, Workload


def stage_params(shape: ModelShape, plan: Plan, stage: int) -> int:
    """Parameters (elements) one rank of pipeline stage `stage` holds, before ZeRO-3."""
    per = shape.layers // plan.pp + (1 if stage < shape.layers % plan.pp else 0)
    n = per * shape.layer_params() // plan.tp
    if stage == 0:
        n += shape.embed_params() // plan.tp
    if stage == plan.pp - 1:
        n += shape.head_params() // plan.tp
    return n


def predict_memory(shape: ModelShape, plan: Plan, work: Workload) -> dict:
    best = None
    shard = plan.dp * plan.cp
    for stage in range(plan.pp):
        p = stage_params(shape, plan, stage)
        params = 4 * p / (shard if plan.zero >= 3 else 1)
        grads = 4 * p / (shard if plan.zero >= 2 else 1)
        optim = 8 * p / (shard if plan.zero >= 1 else 1)
        s, b, h, a = work.seq // plan.cp, plan.micro_batch, shape.hidden, shape.heads
        per_layer = s * b * h * (34 + 5 * a * s / h) / plan.tp * (2 if work.precision == "fp32"
                                                                  else 1)
        layers = shape.layers // plan.pp
        inflight = plan.micro_batches if plan.schedule == "gpipe" else min(
            plan.micro_batches, plan.pp - stage) if plan.pp > 1 else 1
        act = per_layer * layers * inflight
        row = {"parameters": params, "gradients": grads, "optimizer": optim,
               "activations": act, "comm_buffers": 0.0, "feedback": 0.0}
        row = {k: int(v) for k, v in row.items()}
        row["peak_bytes"] = sum(row.values())
        row["where"] = f"pp stage {stage}"
        if best is None or row["peak_bytes"] > best["peak_bytes"]:
            best = row
    return best
