"""Compute seconds of one micro-batch through each module of a pipeline stage (forward,
backward, recompute): measured at the plan's local shape (calibration "compute") or FLOPs
at the calibrated / datasheet rate (pyfast.plan.timing)."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload
from .timing_cp import block_efficiency, causal_efficiency

VOCAB_PARALLEL_MIN = 2048              # pyfast.models.gpt: smaller vocabularies stay whole on tp
BWD_PER_FWD = 2.0                      # backward = 2 forwards of matmul FLOPs (uncalibrated)


# The two below are cached and return tuples (read-only, hashable: timing_reduce._buckets
# caches on them): a search asks for the same few shapes ~600K times (gpt-13b on 16 GPUs).
@lru_cache(maxsize=1024)
def _block_params(shape: ModelShape, tp: int) -> tuple[tuple[int, tuple], ...]:
    """(elements, matrix shape or ()) of one block's parameters on a tp rank, registration order."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_dim
    if shape.arch == "gpt":
        return ((h, ()), (h, ()), (h * (h + 2 * kv) // tp, ((h + 2 * kv) // tp, h)),
                ((h + 2 * kv) // tp, ()), (h * h // tp, (h, h // tp)), (h, ()), (h, ()), (h, ()),
                (f * h // tp, (f // tp, h)), (f // tp, ()), (h * f // tp, (h, f // tp)), (h, ()))
    return ((h, ()), (h * h // tp, (h // tp, h)), (kv * h // tp, (kv // tp, h)),
            (kv * h // tp, (kv // tp, h)), (h * h // tp, (h, h // tp)), (h, ()),
            (f * h // tp, (f // tp, h)), (f * h // tp, (f // tp, h)), (h * f // tp, (h, f // tp)))


def _modules(shape: ModelShape, plan: Plan, stage: int) -> tuple[tuple[str, tuple], ...]:
    """This pipeline stage's modules in forward order: (kind, params) with kind embed/block/head.
    Layers split as the pipeline cuts them (evenly, the remainder to the first stages)."""
    return _stage_modules(shape, plan.tp, plan.pp, stage)


@lru_cache(maxsize=4096)
def _stage_modules(shape: ModelShape, tp: int, pp: int, stage: int) -> tuple:
    v = shape.vocab // tp if shape.vocab >= VOCAB_PARALLEL_MIN else shape.vocab
    per = shape.layers // pp + (1 if stage < shape.layers % pp else 0)
    mods = []
    if stage == 0:
        mods.append(("embed", ((v * shape.hidden, (v, shape.hidden)),)))
    mods += [("block", _block_params(shape, tp))] * per
    if stage == pp - 1:
        norm = ((shape.hidden, ()),) * (2 if shape.arch == "gpt" else 1)
        lm = () if shape.tied else ((v * shape.hidden, (v, shape.hidden)),)
        mods.append(("head", norm + lm))
    return tuple(mods)


def compute_key(kind: str, plan: Plan, work: Workload) -> str:
    """The calibration key of a module's forward + backward at this plan's local shape."""
    s = work.seq // plan.cp
    ck = ":ckpt" if kind == "block" and plan.activation_checkpointing else ""
    return f"{kind}:tp{plan.tp}:b{plan.micro_batch}:s{s}:{work.precision}{ck}"


def _module_s(kind: str, params: list, shape: ModelShape, plan: Plan, work: Workload,
              cluster: Cluster) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one micro-batch through one module."""
    if plan.lora:
        return _lora_module_s(kind, params, shape, plan, work, cluster)
    cal = cluster.calibration
    scale = _compute_scale(cluster, plan)
    toks = plan.micro_batch * work.seq // plan.cp
    peak = cluster.gpu.flops_32 if work.precision == "fp32" else cluster.gpu.flops_16
    rate = cal.get("flops_s") or peak * cluster.mfu
    matmul = sum(n for n, m in params if m)
    fwd_flops = 2.0 * matmul * toks
    own = extra = off = 0.0  # attention: the local causal block's forward; cp's other blocks'
    if kind == "block":  # forward (off) and their forward + backward (extra)
        own, off = attention_s(shape, plan, work, cluster)
        extra = off * (1 + BWD_PER_FWD)
    # a checkpointed block's recompute reruns its whole forward: under cp every ring step's
    # attention too, not only the local block's (the published CP 4 / 8 runs under full
    # recompute were predicted 16-61% fast without them)
    redo = off if kind == "block" and plan.activation_checkpointing else 0.0
    if kind == "embed":  # a gather: memory-bound, ~3 passes over the activations
        fwd_flops = 0.0
    measured = cal.get("compute", {}).get(compute_key(kind, plan, work))
    if kind == "block" and plan.cp > 1:  # the cp block as timed on cp ranks (ring included)
        ring = cal.get("compute", {}).get(compute_key(kind, plan, work) + ":cp")
        if ring is not None:  # timed with its cp ranks running at once: no compute_scale
            return ring[0], ring[1], 0.0
    if kind == "block" and plan.tp > 1 and plan.cp == 1:  # timed on tp ranks, all-reduces in
        dist = cal.get("compute", {}).get(compute_key(kind, plan, work) + ":dist")
        if dist is not None:  # (calibrate_dist.tp_probe): no compute_scale, as cp's
            return dist[0], dist[1], 0.0
    if measured is not None:
        f, b = measured  # b includes the recompute under activation checkpointing
        rec = f if kind == "block" and plan.activation_checkpointing else 0.0
        # --loss-chunks: each chunk's head and loss run again in backward (checkpointed)
        return scale * f, scale * (b - rec + extra), \
            scale * (rec + redo + _head_rerun(kind, plan, f))
    mem = 3.0 * toks * shape.hidden * 4 / cluster.gpu.hbm_bps
    f = fwd_flops / rate + own + mem
    rec = f if kind == "block" and plan.activation_checkpointing else 0.0
    return scale * f, scale * (BWD_PER_FWD * f + extra), \
        scale * (rec + redo + _head_rerun(kind, plan, f))


def attention_s(shape: ModelShape, plan: Plan, work: Workload, cluster: Cluster
                ) -> tuple[float, float]:
    """(the local causal block's, the other cp blocks') forward attention seconds of one
    micro-batch through one block: QK^T + AV, 4 x head dims FLOPs a (query, key) pair; causal
    over s/2 keys a query on average; zigzag keeps every rank's share equal. At a datasheet
    rate: the GPU's attention efficiency (hardware.Gpu.attn_mfu, fitted on torchtitan's
    32,768-token run) and the kernel's on short blocks (timing_cp); a measured CPU rate
    (calibration flops_s) stands for both."""
    toks = plan.micro_batch * work.seq // plan.cp
    hl, s_loc = shape.hidden // plan.tp, work.seq / plan.cp
    cal = cluster.calibration
    peak = cluster.gpu.flops_32 if work.precision == "fp32" else cluster.gpu.flops_16
    if cal.get("flops_s"):
        rate, own_eff, off_eff = cal["flops_s"], 1.0, 1.0
    else:
        rate = peak * (cluster.attn_mfu or cluster.mfu)
        # zigzag's off-diagonal blocks: all queries x half the keys, or half the queries x
        # all the keys (ring_attention.visible): s_loc / 2 or s_loc keys a query tile walks
        own_eff = causal_efficiency(s_loc)
        off_eff = (block_efficiency(s_loc / 2) + block_efficiency(s_loc)) / 2
    own = 2.0 * hl * s_loc * toks / (rate * own_eff)
    off = 2.0 * hl * (work.seq - s_loc) * toks / (rate * off_eff)
    return own, off


def _head_rerun(kind: str, plan: Plan, f: float) -> float:
    """The head's forward again in backward under --loss-chunks (Job.chunked_loss checkpoints
    each chunk's head matmul and loss): its forward's seconds, else 0."""
    return f if kind == "head" and plan.loss_chunks else 0.0


def _lora_module_s(kind: str, params: list, shape: ModelShape, plan: Plan, work: Workload,
                   cluster: Cluster) -> tuple[float, float, float]:
    """A module of a LoRA plan: the frozen base's backward computes the input's gradient
    only (1 forward of matmul FLOPs, not 2; attention's backward stays 2 of its forward; the
    embedding none at all), plus the adapters (2 r (in + out) FLOPs a token forward, twice
    that backward); a base stored int8/nf4 is dequantized (read stored, write the training
    dtype) before each forward and recompute. A measured full-fine-tune module's backward is
    scaled by the analytic ratio."""
    full = _module_s(kind, params, shape, replace(plan, lora=0), work, cluster)
    if kind == "embed":
        return full[0], 0.0, full[2]
    toks = plan.micro_batch * work.seq // plan.cp
    peak = cluster.gpu.flops_32 if work.precision == "fp32" else cluster.gpu.flops_16
    rate = (cluster.calibration.get("flops_s") or peak * cluster.mfu) / \
        _compute_scale(cluster, plan)
    matmul = sum(n for n, m in params if m)
    weight_grad = 2.0 * matmul * toks / rate           # what a frozen base does not compute
    f, b, r = full[0], max(full[1] - weight_grad, 0.0), full[2]
    if kind == "block":
        tb = 4 if work.precision == "fp32" else 2
        ad = shape.adapter_params(plan.lora) / shape.layers
        deq = 0.0
        if plan.base_dtype in ("int8", "nf4"):
            from .finetune import base_layer_bytes
            deq = (base_layer_bytes(shape, plan.base_dtype, tb) +
                   tb * shape.layer_matmul_params()) / cluster.gpu.hbm_bps
        f += 2.0 * ad * toks / rate + deq * _compute_scale(cluster, plan)
        b += 4.0 * ad * toks / rate
        r = f if plan.activation_checkpointing else 0.0
    return f, b, r


def _compute_scale(cluster: Cluster, plan: Plan) -> float:
    """refit's compute_scale: measured / predicted compute of a run of this job (what the
    ranks sharing one machine cost each other's compute is in it)."""
    return cluster.calibration.get("compute_scale", 1.0)
