"""Tensor parallelism's communication in a block (pyfast.plan.timing): blocking, or overlapped
with the matmul each collective feeds or follows (Plan.async_tp).

Blocking (pyfast's job): 2 all-reduces per block forward (attention's and the MLP's output),
2 backward (their inputs' gradients), each waited before the next op. Under sequence
parallelism each is an all-gather before the column-parallel matmuls plus a reduce-scatter
after the row-parallel one, the same bytes (a ring all-reduce is a reduce-scatter then an
all-gather: NCCL's 2 (W-1) steps, half each).

Async (torchtitan's AsyncTP: torch's micro-pipeline TP, fused_all_gather_matmul /
fused_matmul_reduce_scatter; Megatron's tp-comm-overlap; pyfast.parallel.async_tp): each of
the block's 4 collectives is cut into one piece per rank and overlapped with its matmul cut
alike: the all-gather feeding q, k, v (one gather, 3 matmuls), the reduce-scatter after the
attention output's, the all-gather feeding the MLP's up matmuls (w1 and w3; GPT's fc), the
reduce-scatter after its down matmul. A gather multiplies the local piece first and each
arriving one next; a reduce-scatter multiplies the piece of every other rank, sends it and
multiplies the next, its own last. So the matmul of one of W pieces never overlaps a transfer
and the exposed time of a collective of c seconds beside a matmul of mm seconds is
max(0, c - mm (W-1)/W). Backward has the same 4 collectives the other way round (a gather's
gradient is a reduce-scatter, and back), each fused with the input-gradient matmul of the
same linear, whose FLOPs are the forward's; a recomputed forward repeats the forward's.
No constant here is fitted: the published AsyncTP rows (pyfast.plan.published) are held out.
"""
from __future__ import annotations

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload
from .timing_compute import _compute_scale, compute_key
from .timing_link import Link, _cpu_link


def overlapped_params(shape: ModelShape, tp: int) -> tuple[float, float, float, float]:
    """A tp rank's matmul weights beside each of a block's 4 collectives, in forward order:
    (q, k, v | attention output | the MLP's up matmuls | its down matmul)."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_dim
    up = (shape.layer_matmul_params() - h * (h + 2 * kv) - h * h - h * f)  # llama 2 h f, gpt h f
    return (h * (h + 2 * kv) / tp, h * h / tp, up / tp, h * f / tp)


def async_exposed(shape: ModelShape, plan: Plan, work: Workload, cluster: Cluster,
                  ar_s: float) -> float:
    """Exposed seconds of one block forward's 4 overlapped collectives (also its backward's:
    the input-gradient matmuls have the forward's FLOPs). ar_s: one blocking all-reduce of
    the block's activations (2 collectives' bytes)."""
    toks = plan.micro_batch * work.seq // plan.cp
    peak = cluster.gpu.flops_32 if work.precision == "fp32" else cluster.gpu.flops_16
    rate = cluster.calibration.get("flops_s") or peak * cluster.mfu
    hidden = (plan.tp - 1) / plan.tp  # one piece's matmul hides nothing
    c = ar_s / 2
    return sum(max(0.0, c - hidden * 2.0 * n * toks / rate * _compute_scale(cluster, plan))
               for n in overlapped_params(shape, plan.tp))


def tp_block_s(shape: ModelShape, plan: Plan, work: Workload, cluster: Cluster, link: Link,
               act: int, calls: float, bf: float, bb: float) -> tuple[float, float]:
    """(forward, backward) seconds tp's communication adds to one block of one micro-batch
    (the recompute adds the forward's again). bf, bb: the block's compute."""
    toks = plan.micro_batch * work.seq // plan.cp
    ar = link.seconds("all_reduce", toks * shape.hidden * act, calls=calls)
    if plan.async_tp:  # the waits after compute as the blocking path's (0 on a GPU's link)
        exp = async_exposed(shape, plan, work, cluster, ar)
        tp_f, tp_b = exp + 2 * link.wake(bf / 2), exp + 2 * link.wake(bb / 2)
    else:
        tp_f = 2 * (ar + link.wake(bf / 2))   # attention's and the MLP's output, forward
        tp_b = 2 * (ar + link.wake(bb / 2))   # their inputs' gradients, backward
    if plan.tp > 1 and compute_key("block", plan, work) + ":dist" in \
            cluster.calibration.get("compute", {}):
        # the block was timed with its all-reduces on loopback: only the link's extra
        lo = _cpu_link(cluster, plan.tp)
        lo_ar = lo.seconds("all_reduce", toks * shape.hidden * act, calls=calls)
        tp_f = max(0.0, tp_f - 2 * (lo_ar + lo.wake(bf / 2)))
        tp_b = max(0.0, tp_b - 2 * (lo_ar + lo.wake(bb / 2)))
    return tp_f, tp_b
