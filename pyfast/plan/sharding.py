"""ZeRO's shard group in the planner (issue 33): the ranks a plan shards over (all of dp x cp,
or a node's under hybrid sharding) and which compressor runs on which of its collectives.
Shared by the memory model (memory.py) and the time model (timing.py, timing_zero.py)."""
from __future__ import annotations

from .spec import Plan

# the codecs that code blocks of QUANT_BLOCK elements (memory.py's BLOCKED): their shards
# padded to it, and DataParallel's buckets start each parameter at a multiple of it
# (comm.buckets' align)
BLOCKED = ("int8", "int4", "e3m0", "fp8", "sign", "ternary")
QUANT_BLOCK = 512      # pyfast.ops.quantize.DEFAULT_BLOCK: int8/int4/fp8/sign code blocks


def blocked(*names: str) -> bool:
    """Whether any of these compressors codes blocks (its shards padded to QUANT_BLOCK)."""
    return any(c in BLOCKED for c in names)


def shard_group(plan: Plan) -> int:
    """The ranks ZeRO shards over: plan.shard_group (hybrid sharding) or all of dp x cp;
    ValueError when the shard group does not divide dp x cp."""
    n = plan.dp * plan.cp
    g = plan.shard_group
    if not g:
        return n
    if not plan.zero:
        raise ValueError(f"shard_group {g} without ZeRO: hybrid sharding shards ZeRO's state")
    if g < 1 or n % g:
        raise ValueError(f"shard_group {g} does not divide the dp x cp = {plan.dp} x {plan.cp} "
                         f"= {n} ranks that average gradients")
    return g


def check_keep_gathered(plan: Plan) -> None:
    """ValueError when plan.keep_gathered is set where there is nothing to keep: the weights
    kept across micro-batches are ZeRO 3's under a pipeline (torchtitan's PP setting)."""
    if plan.keep_gathered and not (plan.zero == 3 and plan.pp > 1):
        raise ValueError(f"keep_gathered needs ZeRO 3 under a pipeline (got zero {plan.zero}, "
                         f"pp {plan.pp}): it keeps a stage's gathered weights over its "
                         "micro-batches")
    if plan.keep_gathered and plan.lora:
        raise ValueError("keep_gathered with lora: the fine-tuning model (finetune.py) keeps "
                         "no gathered stage; plan one or the other")


def hybrid_compressors(plan: Plan) -> tuple[str, str]:
    """(the reduce-scatter's compressor, the replicas' all-reduce's) of a plan. Hybrid
    sharding: the reduce-scatter inside the node exact, --compress on the cross-node
    all-reduce of each shard (the slow link's bytes); otherwise --compress on the
    reduce-scatter (or DataParallel's all-reduce) and no replicas."""
    if plan.zero and plan.shard_group and plan.shard_group < plan.dp * plan.cp:
        return "none", plan.compress
    return plan.compress, "none"
