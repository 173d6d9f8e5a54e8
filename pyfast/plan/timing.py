"""Step time of a plan: what pyfast's job (pyfast.train.job) does on one rank, part by part.
Pure arithmetic (no torch): ~100 us a plan. docs/plan.md "Time model" explains it.

predict_time(shape, plan, work, cluster) -> {"step_s", "compute_s", "comm_s", "exposed_comm_s",
    "bubble_s", "recompute_s", "codec_s", "tokens_per_s", "steps_factor", "optimizer_s",
    "tp_comm_s", "cp_comm_s", "pp_comm_s", "dp_comm_s", "zero_comm_s", "why"}
    compute_s: forward + backward (+ recompute) of every micro-batch on the slowest stage;
    comm_s: every collective's seconds; exposed_comm_s: the part compute does not hide;
    steps_factor: steps to a target loss relative to no compression (1 + STEPS_PER_ERROR x the
    compressor's relative error).

The step, as the job runs it (1 rank; `m` micro-batches of `micro_batch` sequences, seq/cp tokens
each): forward + backward of each micro-batch through this stage's modules (embedding, blocks,
head + loss), with tp's all-reduces inside (blocking: 2 per block forward, 2 backward, 2 more in
a recomputed forward; or overlapped with their matmuls, Plan.async_tp: timing_tp.py), cp's ring K/V exchange (per step a latency, the transfer the step's
attention does not hide and the merge: timing_cp.py) or Ulysses' all-to-alls (blocking), pp's activations and gradients between stages plus the bubble;
then the dp x cp gradient reduction: DataParallel's buckets (first 1 MB, then 4 MB, in reverse
registration order; top-k and PowerSGD per parameter) reduced in order on one communication
thread while the last micro-batch's backward runs (after the pipeline when pp > 1), each bucket
encode + wire + decode as pyfast.comm.cost.comm_seconds; or ZeRO's reduce-scatter (stage 1 at
the step, 2 and 3 overlapped) and parameter all-gathers (stages 1-2 after the step, stage 3 per
module in forward and backward, prefetched one ahead; once a step under
Plan.keep_gathered); then the small all-reduce of the step's
loss/norm and the optimizer.

cluster.calibration (pyfast.plan.calibrate documents the keys): measured per-module seconds at
local shapes ("compute"), the measured FLOP rate ("flops_s"), the optimizer's seconds per
parameter, a fitted link per group ("link_intra", "link_inter": cost.LinkModel's fits),
codec seconds per element ("codec"), and the refit's "compute_scale" / "comm_scale".
"""
from __future__ import annotations

import functools

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload
from .timing_compute import (BWD_PER_FWD, VOCAB_PARALLEL_MIN, _block_params,  # noqa: F401
                             _compute_scale, _modules, _module_s, attention_s, compute_key)
from .timing_cp import ring_steps
from .timing_link import SMALL_BYTES, Link, _cpu_link  # noqa: F401
from .timing_reduce import (ALLGATHER_MAX_BYTES, BUCKET_MB, DENSE_BYTES,  # noqa: F401
                            FIRST_BUCKET_MB, NONE_BUCKET_MB, PER_PARAM, REL_ERROR,
                            STEPS_PER_ERROR, _bucket_cost, _codec, _fifo, _trainable,
                            dp_buckets, reduction_s, rel_error, steps_factor)
from .sharding import check_keep_gathered, shard_group
from .timing_tp import tp_block_s
from .timing_zero import _zero, zero_key


def pp_key(plan: Plan) -> str:
    """The calibration key of a pipeline plan's runtime cost (calibrate_dist.measure_pp)."""
    return f"{plan.schedule}:pp{plan.pp}:m{plan.micro_batches}:v{plan.virtual_stages}"


def predict_time(shape: ModelShape, plan: Plan, work: Workload, cluster: Cluster) -> dict:
    check_keep_gathered(plan)
    if plan.offload != "none":  # the plan on the device, then the host's and PCIe's seconds
        return _offloaded(shape, plan, work, cluster)
    first = _predict(shape, plan, work, cluster, None)
    if not Link(cluster, plan.ranks, 2).tbf:
        return first
    # a token-bucket link: the bucket regains rate x the step's time at wire speed (the
    # first pass), shared by the step's calls; what a call sends beyond its share (or beyond
    # the burst) waits for the rate (Link._bucket_s). A rate-bound step so takes its bytes /
    # rate, as a fluid bucket: the tokens gained while it waits are the ones it sends.
    return _predict(shape, plan, work, cluster, first["step_s"])


def _predict(shape: ModelShape, plan: Plan, work: Workload, cluster: Cluster,
             free_step_s: float | None) -> dict:
    m, p, v = plan.micro_batches, plan.pp, plan.virtual_stages
    act = 2 if work.precision in ("bf16", "fp16") else 4   # autocast outputs
    toks = plan.micro_batch * work.seq // plan.cp
    tp_link = Link(cluster, plan.tp, plan.tp)
    cp_link = Link(cluster, plan.tp * plan.cp, plan.cp)
    dp_link = Link(cluster, plan.tp * plan.cp * plan.dp, plan.dp * plan.cp)
    pp_link = Link(cluster, plan.ranks, 2 if p > 1 else 1)
    for lk in (tp_link, cp_link, dp_link, pp_link):
        if lk.tbf and free_step_s is not None:
            lk.refill = lk.tbf[0] * free_step_s
    # per stage: (fwd, bwd, recompute) of one micro-batch, with tp and cp inside each block
    stages = []
    # one block's (forward, backward, recompute): the compute a blocking wait follows
    memo = {}

    def mod_s(kind, params):  # every block of a plan is the same: one computation per kind
        if kind not in memo:
            memo[kind] = _module_s(kind, params, shape, plan, work, cluster)
        return memo[kind]
    bf, bb, _ = mod_s("block", _block_params(shape, plan.tp))
    nblocks = -(-shape.layers // p)
    ck = plan.activation_checkpointing
    tp_f, tp_b = tp_block_s(shape, plan, work, cluster, tp_link, act,
                            m * nblocks * (6 if ck else 4), bf, bb)
    kv = 2.0 * toks * shape.kv_dim // plan.tp * act
    if plan.cp > 1 and plan.cp_method == "ulysses":  # q, k, v in and the output back
        a2a = cp_link.seconds("all_to_all", toks * shape.hidden // plan.tp * act,
                              m * nblocks * 8)
        cp_f, cp_b = 4 * (a2a + cp_link.wake(bf / 4)), 4 * (a2a + cp_link.wake(bb / 4))
    else:  # ring: cp-1 K/V exchanges forward, K/V + dK/dV backward, hidden behind attention
        calls = m * nblocks * (plan.cp - 1) * (3 if ck else 2)
        cp_f = (plan.cp - 1) * (cp_link.seconds("p2p", kv, calls) + cp_link.wake(bf / 2))
        cp_b = (plan.cp - 1) * (cp_link.seconds("p2p", 2 * kv, calls) + cp_link.wake(bb / 2))
    cp_measured = compute_key("block", plan, work) + ":cp" in cluster.calibration.get(
        "compute", {})
    if cp_measured:  # the same exchanges at loopback speed (what the measured block holds)
        lo = _cpu_link(cluster, plan.cp)
        cp_cpu = (plan.cp - 1) * (lo.seconds("p2p", kv) + lo.seconds("p2p", 2 * kv)) \
            if plan.cp_method != "ulysses" else 4 * 2 * lo.seconds(
                "all_to_all", toks * shape.hidden // plan.tp * act)
        cp_cpu += 2 * (plan.cp - 1) * lo.wake(bf / 2) if plan.cp_method != "ulysses" else \
            4 * (lo.wake(bf / 4) + lo.wake(bb / 4))
    ring_cp = (0.0, 0.0)
    if plan.cp > 1 and plan.cp_method != "ulysses" and not cp_measured:
        rf, rb = ring_steps(shape, plan, work, cp_link, act,
                            attention_s(shape, plan, work, cluster)[1], cluster.gpu.hbm_bps)
        ring_cp = (rf + (plan.cp - 1) * cp_link.wake(bf / 2),
                   rb + (plan.cp - 1) * cp_link.wake(bb / 2))
    for st in range(p):
        mods = _modules(shape, plan, st)
        f = b = r = tpc = cpc = 0.0
        for kind, ps in mods:
            mf, mb, mr = mod_s(kind, ps)
            f, b, r = f + mf, b + mb, r + mr
            if kind == "block":
                if plan.tp > 1:
                    tpc += tp_f + tp_b + (tp_f if plan.activation_checkpointing else 0.0)
                if plan.cp > 1 and cp_measured:  # the block's timing holds loopback's traffic
                    cpc += max(0.0, cp_f + cp_b - cp_cpu)
                elif plan.cp > 1 and plan.cp_method == "ulysses":  # blocking all-to-alls
                    cpc += cp_f + cp_b + (cp_f if plan.activation_checkpointing else 0.0)
                elif plan.cp > 1:  # ring: per step a latency, what attention does not hide
                    rf, rb = ring_cp
                    cpc += rf + rb + (rf if plan.activation_checkpointing else 0.0)
        stages.append((mods, f, b, r, tpc, cpc))
    per_mb = [f + b + r + tpc + cpc for _, f, b, r, tpc, cpc in stages]
    slow = max(range(p), key=lambda i: per_mb[i])
    mods, f, b, r, tpc, cpc = stages[slow]
    t_mb = per_mb[slow]
    compute = m * (f + b + r)
    # pipeline: activations forward and gradients backward over each boundary, per micro-batch
    pp_c = 0.0
    bubble = 0.0
    if p > 1:
        # a 1 KB header each way carries the step's first message (pyfast.parallel.p2p: layouts
        # agreed once, so after the first step no message of its own): its bytes spread over
        # the step's 2 m v messages
        hop = pp_link.seconds("p2p", toks * shape.hidden * 4 + 1024 / (m * v), 2 * m * v)
        # each rank waits on one receive per micro-batch (the first stage for gradients, the
        # last for activations; sends are isend), each transfer on the critical path once
        pp_c = m * v * (2 * hop + pp_link.wake((f + b) / (2 * v)))
        # the step's outcome: the rank that finishes last finds the others' flags waiting and
        # sends it back, one small message after its last action (outcome.Flags)
        pp_c += pp_link.seconds("small", SMALL_BYTES) + pp_link.wake(0.0)
        # the runtime's own time a micro-batch and virtual stage, where measured (a CPU
        # cluster's calibrate_dist.pp_probe: packing, sends, the Python between actions)
        pp_c += m * v * cluster.calibration.get("pp", {}).get(pp_key(plan), 0.0)
        bub = (p - 1) / v * t_mb
        bubble = bub / 3 if plan.schedule == "zb-h1" else bub
    body = m * t_mb + bubble + pp_c
    # data parallel over dp x cp
    world = plan.dp * plan.cp
    dp_c = zero_c = codec = exposed_dp = 0.0
    # what the reduction and the optimizer see: every parameter, or a LoRA plan's adapters
    # (the frozen base is never reduced; under ZeRO 3 with the base sharded, each unit's
    # gather also carries its base in the stored format)
    gmods, frozen = _trainable(shape, plan, mods, work) if plan.lora else (mods, None)
    n_local = n_of(gmods)
    cal = cluster.calibration
    cont = cal.get("cpu_contention", 0.0)
    cpu_link = _cpu_link(cluster, world)
    # measured at this stage, compressor and micro-batch on 2 ranks (calibrate_dist.zero_probe)
    zero_m = cal.get("zero", {}).get(zero_key(plan, work)) \
        if world == 2 and p == 1 and not plan.shard_group else None
    ns = shard_group(plan)  # ZeRO's shards: over dp x cp, or a node's ranks (hybrid)
    n_opt = n_local / ns if plan.zero and zero_m is None else n_local
    if plan.zero and ns < world:  # hybrid: the shard group in the node, replicas across nodes
        dp_link = Link(cluster, plan.tp * ns, ns)
        rep_link = Link(cluster, plan.tp * plan.cp * plan.dp, world // ns)
        for lk in (dp_link, rep_link):
            if lk.tbf and free_step_s is not None:
                lk.refill = lk.tbf[0] * free_step_s
    else:
        rep_link = None
    dp_m, hooks = None, 0.0
    if not plan.zero:  # DataParallel's measured wait replaces the arithmetic's, below
        dp_m, zero_m = zero_m, None
    opt_rate = cluster.calibration.get("optim_s_per_param")
    optim = (opt_rate * n_opt if opt_rate is not None else 64.0 * n_opt / cluster.gpu.hbm_bps) \
        * _compute_scale(cluster, plan)
    optim += cal.get("step_overhead_s", 0.0) * _compute_scale(cluster, plan)  # the job's own
    if world > 1 and not plan.zero:
        # DataParallel's hooks (measured: zero_probe's stage 0 less its wait; gpt-small int8
        # 61-75 ms) run inside the backward on the main thread: its buckets come ready that
        # much later and further apart. Put after the backward instead, the 1 Gbit/s link's
        # extra wait came out 74-109 ms where the runs waited 40-72 beyond loopback's probe
        # (four runs; seven plan_time runs replayed: +4% to +30%, now -11% to +12%)
        if dp_m is not None and len(dp_m) > 2:
            hooks = max(0.0, dp_m[0] - dp_m[2]) * _compute_scale(cluster, plan)
        dp_c, codec, exposed_dp = _dp_exposed(plan, gmods, mods, dp_link, cpu_link, cluster,
                                              body, (f, b, r, tpc + cpc), mod_s, stretch=hooks)
        # the wait after the step's compute since the ranks last met (the previous step's
        # small all-reduce): a rank's lead over its peer grows with it (wake_seconds' table)
        exposed_dp += dp_link.wake(body + optim)
        if dp_m is not None:  # measured on loopback (zero_probe's stage 0): the hooks and the
            # last bucket's wait as they were, plus what this link adds to the arithmetic's
            last = (f, b, r, tpc + cpc)
            link_exp = exposed_dp - dp_link.wake(body + optim)
            # top-k's / PowerSGD's calls: the probe ran them, so this link's extra is its fits'
            # over loopback's; reduce_seconds' timed calls (the link's alone: loopback's
            # link_cpu has none) would count the calls' own overheads twice
            fits_only = plan.compress.partition(":")[0] in PER_PARAM
            if fits_only:
                link_exp = _dp_exposed(plan, gmods, mods, dp_link, cpu_link, cluster, body,
                                       last, mod_s, fits_only, stretch=hooks)[2]
            lo_exp = _dp_exposed(plan, gmods, mods, cpu_link, cpu_link, cluster, body, last,
                                 mod_s, fits_only, stretch=hooks)[2]
            extra = max(0.0, link_exp - lo_exp)
            if len(dp_m) > 2:  # the wait apart: the hooks' CPU is compute, as the job logs it
                # (gpt-tiny on loopback: extra 10.8 ms, of it 5.8 the run's measured wait)
                exposed_dp = max(0.0, dp_m[2] + dp_m[1] + extra)
            else:
                exposed_dp = max(0.0, dp_m[0] + dp_m[1] + extra)
    elif world > 1 and zero_m is not None:
        # ZeRO's per-step costs as calibrate_dist.zero_probe timed them on loopback (beyond a
        # plain local step, whose optimizer is the whole model's), plus what this link adds
        zero_c, exposed_dp = _zero(plan, gmods, dp_link, cluster, body, mod_s, frozen)
        _, lo_exp = _zero(plan, gmods, cpu_link, cluster, body, mod_s, frozen)
        fb, st = zero_m
        exposed_dp = max(0.0, fb * (m if plan.zero == 3 else 1) + st +
                         max(0.0, exposed_dp - lo_exp))
    elif world > 1:
        zero_c, exposed_dp = _zero(plan, gmods, dp_link, cluster, body, mod_s, frozen, rep_link)
        exposed_dp += dp_link.wake(bb)  # the step's wait for the last reduce-scatter
        if cont and plan.zero >= 2:
            zero_c_cpu, _ = _zero(plan, gmods, cpu_link, cluster, body, mod_s, frozen)
            exposed_dp += cont * zero_c_cpu
    # the step's small all-reduce (loss, norm, flag, bytes) over every rank, and the optimizer
    every = Link(cluster, plan.ranks, plan.ranks)
    small = every.seconds("small", 32.0) + every.wake(0.0)  # after the norm pass
    step = body + hooks + exposed_dp + small + optim
    compute += hooks
    comm = m * (tpc + cpc) + pp_c + dp_c + zero_c + small
    exposed = step - compute - bubble - optim
    why = []
    for k, x in (("exposed comm", exposed), ("bubble", bubble), ("recompute", m * r),
                 ("codec", codec), ("optimizer", optim)):
        if x > 0.05 * step:
            why.append(f"{k} {100 * x / step:.0f}%")
    return {"step_s": step, "compute_s": compute, "comm_s": comm, "exposed_comm_s": exposed,
            "bubble_s": bubble, "recompute_s": m * r, "codec_s": codec,
            "tokens_per_s": work.tokens / step, "steps_factor": steps_factor(plan.compress),
            "optimizer_s": optim, "tp_comm_s": m * tpc, "cp_comm_s": m * cpc, "pp_comm_s": pp_c,
            "dp_comm_s": dp_c, "zero_comm_s": zero_c, "stage": slow,
            "why": ", ".join(why) or "compute-bound"}


def _dp_exposed(plan: Plan, gmods: list, mods: list, link: Link, cpu_link: Link,
                cluster: Cluster, body: float, last: tuple, mod_s,
                fits_only: bool = False, stretch: float = 0.0) -> tuple[float, float, float]:
    """(comm seconds, codec seconds, exposed seconds) of DataParallel's reduction on `link`:
    its buckets in reverse registration order on one thread behind the last micro-batch's
    backward (after the pipeline when pp > 1), then the side band's small all-reduce and the
    copy of the buckets into .grad. last: the slowest stage's (forward, backward, recompute,
    tp + cp seconds) of one micro-batch. fits_only: reduction_s's measured_calls=False.
    stretch: the main thread's own seconds inside that backward (DataParallel's hooks), spread
    over the buckets by their elements."""
    f, b, r, par = last
    cal = cluster.calibration
    bks = dp_buckets(gmods, plan.compress)
    memo = {}  # by (elements, first tensor): most of a model's buckets repeat one of a few

    def bucket(bk, lk, calls=1):
        key = (bk[0], bk[1][0], lk, calls)  # a Link hashes by identity
        if key not in memo:
            memo[key] = _bucket_cost(plan.compress, bk, lk, cluster, calls, not fits_only)
        return memo[key]
    cost, cdc = zip(*(bucket(bk, link, len(bks)) for bk in bks))
    dp_c, codec = sum(cost), sum(cdc)
    if plan.pp > 1:  # reduce_gradients() after the pipeline: nothing to hide behind
        exposed = dp_c
    else:  # the last micro-batch's backward, module by module from the head down
        start = body - b - r - par * (b + r) / max(f + b + r, 1e-30)
        done, t = {}, start
        for i in reversed(range(len(mods))):
            kf, kb, kr = mod_s(*mods[i])
            t += (kb + kr) * (1 + par / max(f + b + r, 1e-30))
            done[i] = t
        ready, total, seen = [], sum(bk[0] for bk in bks) or 1, 0
        for n, _, i in bks:
            seen += n
            ready.append(done[i] + stretch * seen / total)
        end = _fifo(ready, cost)
        exposed = max(0.0, end - body - stretch)
        # what the overlap cannot hide where the ranks fill the cores: the communication
        # thread's own CPU work (codec, gloo's copies at loopback speed)
        cont = cal.get("cpu_contention", 0.0)
        if cont:
            exposed += cont * sum(bucket(bk, cpu_link)[0] for bk in bks)
    copy = cal.get("copy_s_per_byte", 1.0 / cluster.gpu.hbm_bps)
    exposed += link.seconds("small", SMALL_BYTES) + 4.0 * n_of(gmods) * copy * \
        _compute_scale(cluster, plan)
    return dp_c, codec, exposed


@functools.lru_cache(maxsize=4096)
def n_of(mods: tuple) -> int:
    """Elements in modules (timing_compute._modules' cached tuples)."""
    return sum(n for _, ps in mods for n, _ in ps)


def _offloaded(shape: ModelShape, plan: Plan, work: Workload, cluster: Cluster) -> dict:
    """An offload plan's time: offload.offload_time over the same plan without offload; the
    host steps this rank's shard of the trainable parameters (a LoRA plan's adapters), and
    params offload fetches a sharded base's stored bytes too."""
    from .offload import offload_time
    t = predict_time(shape, plan.replace(offload="none"), work, cluster)
    ns = shard_group(plan)
    if plan.lora:
        from .finetune import base_bytes, head_weight_bytes
        n_local = shape.adapter_params(plan.lora)
        tb = 4 if work.precision == "fp32" else 2
        base = base_bytes(shape, plan.base_dtype, tb, head=head_weight_bytes(work.precision)) \
            / ns if plan.base_placement == "shard" and plan.offload == "params" else 0.0
    else:
        n_local, base = shape.params() / (plan.tp * plan.pp), 0.0
    units = -(-shape.layers // plan.pp) + 2
    return offload_time(shape, plan, work, cluster, t, n_local / ns, base, units, BWD_PER_FWD)
