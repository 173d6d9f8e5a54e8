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
a recomputed forward), cp's ring K/V exchange (overlapped with the attention it feeds) or
Ulysses' all-to-alls (blocking), pp's activations and gradients between stages plus the bubble;
then the dp x cp gradient reduction: DataParallel's buckets (first 1 MB, then 4 MB, in reverse
registration order; top-k and PowerSGD per parameter) reduced in order on one communication
thread while the last micro-batch's backward runs (after the pipeline when pp > 1), each bucket
encode + wire + decode as pyfast.comm.cost.comm_seconds; or ZeRO's reduce-scatter (stage 1 at
the step, 2 and 3 overlapped) and parameter all-gathers (stages 1-2 after the step, stage 3 per
module in forward and backward, prefetched one ahead); then the small all-reduce of the step's
loss/norm and the optimizer.

cluster.calibration (pyfast.plan.calibrate documents the keys): measured per-module seconds at
local shapes ("compute"), the measured FLOP rate ("flops_s"), the optimizer's seconds per
parameter, a fitted link per group ("link_intra", "link_inter": cost.LinkModel's fits),
codec seconds per element ("codec"), and the refit's "compute_scale" / "comm_scale".
"""
from __future__ import annotations

import math
from dataclasses import replace

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload

# pyfast.comm.cost.STEPS_PER_ERROR (kept equal by tests/test_plan_timing.py; no torch here)
STEPS_PER_ERROR = 0.5
# Relative error ||D(C(g)) - g|| / ||g|| of one compression of a gradient, per compressor family:
# int8 0.013, fp8 0.026, int4 0.165: bench/results/ablate on gpt-tiny (pyfast/comm/cost.py's
# STEPS_PER_ERROR note); bf16 0.0023 and fp16 0.0003: round-to-nearest's rms error of 8 and 11
# mantissa bits (2^-p / sqrt(12) x ~1.15 for the exponent spread), the same as cost.relative_error
# gives on gpt-tiny's gradients (0.0022 / 0.0003, tests/test_plan_timing.py checks within 2x);
# topk:R and randomk:R ~ sqrt(1 - R) (the dropped energy of a heavy-tailed gradient: measured
# 0.97 at R=0.01 on gpt-tiny), powersgd:r ~ 0.6 (rank-4 on gpt-tiny's 64x64 and 64x256
# matrices; ternary/sign 0.5-0.8); e3m0 0.20 (gpt-tiny's gradients at init and after 20 AdamW
# steps: 0.193 and 0.203, int4 0.146 and 0.121 on the same: its levels 2^-6..1 of the block's
# max round coarser than int4's 15 even ones). Error feedback makes up most of it over steps:
# these numbers times STEPS_PER_ERROR are the extra steps, as the ablation's model has them.
REL_ERROR = {"none": 0.0, "bf16": 0.0023, "fp16": 0.0003, "int8": 0.013, "fp8": 0.026,
             "int4": 0.165, "e3m0": 0.20, "sign": 0.8, "ternary": 0.5, "powersgd": 0.6}
# Bytes on the wire per gradient element of the dense compressors (pyfast.compress wire_bytes:
# int8/fp8 1 byte + a 4-byte scale per 512-element block, int4 half a byte + the same)
DENSE_BYTES = {"bf16": 2.0, "fp16": 2.0, "int8": 1 + 4 / 512, "fp8": 1 + 4 / 512,
               "int4": 0.5 + 4 / 512, "e3m0": 0.5 + 4 / 512, "sign": 1 / 8 + 4 / 512,
               "ternary": 0.25 + 4 / 512}
FIRST_BUCKET_MB, BUCKET_MB = 1.0, 4.0  # pyfast.comm.buckets / pyfast.parallel.data
NONE_BUCKET_MB = 25.0  # pyfast.comm.buckets: DataParallel's default for compressor "none"
ALLGATHER_MAX_BYTES = 1 << 20          # collectives.choose: dense payloads up to this all-gather
VOCAB_PARALLEL_MIN = 2048              # pyfast.models.gpt: smaller vocabularies stay whole on tp
BWD_PER_FWD = 2.0                      # backward = 2 forwards of matmul FLOPs (uncalibrated)
SMALL_BYTES = 16.0


def rel_error(spec: str) -> float:
    name, _, arg = spec.partition(":")
    if name in ("topk", "randomk"):
        return math.sqrt(max(0.0, 1.0 - float(arg or 0.01)))
    if name not in REL_ERROR:
        raise ValueError(f"no relative error known for compressor {spec!r}")
    return REL_ERROR[name]


def steps_factor(spec: str) -> float:
    return 1.0 + STEPS_PER_ERROR * rel_error(spec)


# ---------------------------------------------------------------- links
class Link:
    """seconds(prim, nbytes one rank contributes) on a group of `world` ranks: a fitted
    cost.LinkModel (calibration) or the alpha-beta ring model of (latency, bytes/s)."""

    def __init__(self, cluster: Cluster, span: int, world: int):
        self.world = world
        lat, bw = cluster.link(span)
        self.fit = cluster.calibration.get("link_intra" if cluster.within_node(span)
                                           else "link_inter")
        self.lat, self.bw = lat, bw
        self.scale = cluster.calibration.get("comm_scale", 1.0)
        # a blocking wait that follows compute: waking the waiting thread (calibrate.wake_seconds)
        self.table = (self.fit or {}).get("wake_s") if world > 1 else None
        self.set_fit(self.fit, cluster.calibration.get("link_cpu"))
        # bytes the bucket regains in a step (predict_time's 2nd pass); None: no wait for the
        # rate at all (the 1st pass: the step's time with the link at wire speed)
        self.refill = None

    def set_fit(self, fit, base=None) -> None:
        """A fit with "tbf": [rate bytes/s, burst bytes] is a token-bucket link (the
        namespaces' tc tbf, calibrate.probe_link): its bytes pass at wire speed (`base`: the
        loopback fit's slope) while the bucket has tokens, and at the rate beyond them."""
        self.fit = fit
        self.tbf = (fit or {}).get("tbf") if base is not None else None
        self.base = base
        if self.tbf and self.table is not None:  # waking a thread is the machine's, not the link's
            self.table = base.get("wake_s", self.table)

    def wire_bytes(self, prim: str, nbytes: float) -> float:
        """Bytes all ranks put on one shared link for a call (a namespace's lo: both
        directions cross one qdisc): ring all-reduce 2(W-1) n, all-gather W(W-1) n,
        all-to-all (W-1) n, p2p n."""
        w = self.world
        return {"all_reduce": 2 * (w - 1), "all_gather": w * (w - 1), "all_to_all": w - 1,
                "p2p": 1}[prim] * nbytes

    def _bucket_s(self, prim: str, nbytes: float, calls: float) -> float:
        """One of `calls` calls of a step on a token bucket of rate R and burst B: the call as
        on loopback (the `base` fit: tbf passes packets untouched while it has tokens; the
        shaped probe's own 256 B calls came out 0.2-1.9 ms from one probe to the next against
        0.25 on loopback, and gpt-tiny's pp2 stepped in 29 ms on loopback, 1 Gbit/s and
        100 Mbit/s alike), and the bytes beyond the call's tokens at R. A call's tokens: its share
        of what the bucket regains while the step computes (refill / calls: the step's calls
        come spread over it), at most B. gpt-tiny at 100 Mbit/s (12.5 MB/s, B 512 KiB):
        pp2's 8 transfers of 32 KB in a 29 ms step get 45 KB each, pass free (measured 29 ms
        as on loopback); tp2's 8 all-reduces of 131 KB (262 KB on the wire) get 47 KB and
        wait 17 ms each: 168 ms predicted, 166 measured."""
        key = "all_reduce" if prim == "p2p" else prim
        a, b, _ = self.base["fits"][key]
        b = b / (2 if prim == "p2p" else 1)
        rate, burst = self.tbf
        if self.refill is None:
            return a + b * nbytes
        tokens = min(burst, self.refill / max(calls, 1.0))
        return a + b * nbytes + max(0.0, self.wire_bytes(prim, nbytes) - tokens) / rate

    def wake(self, after_s: float) -> float:
        """Extra seconds of a blocking wait after `after_s` of compute (the calibration's
        table, interpolated linearly in log(after_s), held at its ends)."""
        t = self.table
        if not t:
            return 0.0
        if after_s <= t[0][0]:
            return self.scale * t[0][1]
        for (x0, y0), (x1, y1) in zip(t, t[1:]):
            if after_s <= x1:
                u = math.log(after_s / x0) / math.log(x1 / x0)
                return self.scale * (y0 + u * (y1 - y0))
        return self.scale * t[-1][1]

    def seconds(self, prim: str, nbytes: float, calls: float = 1.0) -> float:
        """One of `calls` such calls a step makes: a token-bucket link's `free` bytes (its
        burst, refilled while the step computes) are shared by the step's calls: gpt-tiny's
        tp2 at 100 Mbit/s makes 8 all-reduces of 131 KB about 0.5 ms apart, measured 166 ms
        a step = its 2.1 MB at the rate, not 8 x 131 KB let through free."""
        if self.world <= 1:
            return 0.0
        w = self.world
        if self.fit is not None:
            if prim == "small":
                return self.scale * (self.base if self.tbf else self.fit)["small_s"]
            if self.tbf:
                return self.scale * self._bucket_s(prim, nbytes, calls)
            a, b, free = self.fit["fits"]["all_reduce" if prim == "p2p" else prim]
            # p2p: one rank sends nbytes; a 2-rank all-reduce of nbytes puts 2 x nbytes on
            # the (shared) link, both ranks sending half of it twice
            b = b / 2 if prim == "p2p" else b
            return self.scale * (a + b * max(0.0, nbytes - free / max(calls, 1.0)))
        calls, moved = {"all_reduce": (2 * (w - 1), 2 * (w - 1) / w * nbytes),
                        "all_gather": (w - 1, (w - 1) * nbytes),
                        "all_to_all": (w - 1, (w - 1) / w * nbytes),
                        "p2p": (1, nbytes), "small": (2 * (w - 1), 0.0)}[prim]
        return self.scale * (calls * self.lat + moved / self.bw)


# ---------------------------------------------------------------- the local model
def _block_params(shape: ModelShape, tp: int) -> list[tuple[int, tuple]]:
    """(elements, matrix shape or ()) of one block's parameters on a tp rank, registration order."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_dim
    if shape.arch == "gpt":
        return [(h, ()), (h, ()), (h * (h + 2 * kv) // tp, ((h + 2 * kv) // tp, h)),
                ((h + 2 * kv) // tp, ()), (h * h // tp, (h, h // tp)), (h, ()), (h, ()), (h, ()),
                (f * h // tp, (f // tp, h)), (f // tp, ()), (h * f // tp, (h, f // tp)), (h, ())]
    return [(h, ()), (h * h // tp, (h // tp, h)), (kv * h // tp, (kv // tp, h)),
            (kv * h // tp, (kv // tp, h)), (h * h // tp, (h, h // tp)), (h, ()),
            (f * h // tp, (f // tp, h)), (f * h // tp, (f // tp, h)), (h * f // tp, (h, f // tp))]


def _modules(shape: ModelShape, plan: Plan, stage: int) -> list[tuple[str, list]]:
    """This pipeline stage's modules in forward order: (kind, params) with kind embed/block/head.
    Layers split as the pipeline cuts them (evenly, the remainder to the first stages)."""
    tp, pp = plan.tp, plan.pp
    v = shape.vocab // tp if shape.vocab >= VOCAB_PARALLEL_MIN else shape.vocab
    per = shape.layers // pp + (1 if stage < shape.layers % pp else 0)
    mods = []
    if stage == 0:
        mods.append(("embed", [(v * shape.hidden, (v, shape.hidden))]))
    mods += [("block", _block_params(shape, tp)) for _ in range(per)]
    if stage == pp - 1:
        norm = [(shape.hidden, ())] * (2 if shape.arch == "gpt" else 1)
        lm = [] if shape.tied else [(v * shape.hidden, (v, shape.hidden))]
        mods.append(("head", norm + lm))
    return mods


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
    extra = 0.0  # cp: attention over the other ranks' keys, beyond the local causal block
    if kind == "block":
        hl = shape.hidden // plan.tp
        fwd_flops += 2.0 * hl * work.seq / plan.cp * toks  # causal: QK^T + AV over s/2 keys
        extra = 2.0 * hl * (work.seq - work.seq / plan.cp) * toks * (1 + BWD_PER_FWD) / rate
    if kind == "embed":  # a gather: memory-bound, ~3 passes over the activations
        fwd_flops = 0.0
    measured = cal.get("compute", {}).get(compute_key(kind, plan, work))
    if kind == "block" and plan.cp > 1:  # the cp block as timed on cp ranks (ring included)
        ring = cal.get("compute", {}).get(compute_key(kind, plan, work) + ":cp")
        if ring is not None:  # timed with its cp ranks running at once: no compute_scale
            return ring[0], ring[1], 0.0
    if measured is not None:
        f, b = measured  # b includes the recompute under activation checkpointing
        rec = f if kind == "block" and plan.activation_checkpointing else 0.0
        # --loss-chunks: each chunk's head and loss run again in backward (checkpointed)
        return scale * f, scale * (b - rec + extra), scale * (rec + _head_rerun(kind, plan, f))
    mem = 3.0 * toks * shape.hidden * 4 / cluster.gpu.hbm_bps
    f = fwd_flops / rate + mem
    rec = f if kind == "block" and plan.activation_checkpointing else 0.0
    return scale * f, scale * (BWD_PER_FWD * f + extra), \
        scale * (rec + _head_rerun(kind, plan, f))


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


# ---------------------------------------------------------------- gradient reduction
def _codec(spec: str, n: float, cluster: Cluster) -> tuple[float, float]:
    """(encode, decode) seconds of spec on n elements: calibrated a + b n, or 2 passes of
    fp32 over memory each (read, write)."""
    if spec == "none":
        return 0.0, 0.0
    fit = cluster.calibration.get("codec", {}).get(spec)
    sc = cluster.calibration.get("compute_scale", 1.0)  # the comm thread's: no slowdown twice
    if fit is not None:
        ea, eb, da, db = fit
        return sc * (ea + eb * n), sc * (da + db * n)
    t = 8.0 * n / cluster.gpu.hbm_bps
    return t, t


def reduction_s(spec: str, n: int, mat: tuple, link: Link, cluster: Cluster,
                calls: int = 1) -> tuple[float, float]:
    """(total, codec) seconds of one all_reduce of n elements through spec (cost.comm_seconds's
    algorithm: wire calls as collectives runs them, codec passes per algorithm)."""
    w = link.world
    name = spec.partition(":")[0]
    if name == "none":
        return link.seconds("all_reduce", 4.0 * n, calls), 0.0
    enc, dec = _codec(spec, n, cluster) if name != "powersgd" or mat else (0.0, 0.0)
    measured = (link.fit or {}).get("reduce", {}).get(spec) if w == 2 else None
    if measured is not None:  # top-k / PowerSGD: DataParallel's per-parameter calls
        # as calibrate.reduce_seconds timed the whole call on this link (codec included:
        # its dependent collectives, helper-thread hand-offs and wake-ups are what the
        # latency fit misses, ~1-2.5 ms a gpt-tiny parameter); PowerSGD's vectors (plain
        # all-reduces) their own measured call
        if name == "powersgd" and not mat:
            return link.scale * measured[2], 0.0
        return link.scale * (measured[0] + measured[1] * n), enc + dec * (
            w if name == "topk" else 1)
    if name == "powersgd" and not mat:  # a vector: PowerSGD all-reduces it as it is
        return link.seconds("all_reduce", 4.0 * n, calls), 0.0
    if name == "powersgd":
        r = min(int(spec.partition(":")[2] or 1), mat[0], mat[1])
        wire = link.seconds("all_reduce", 4.0 * mat[0] * r, 2 * calls) + link.seconds(
            "all_reduce", 4.0 * mat[1] * r, 2 * calls)
        return wire + enc + dec, enc + dec
    if name in ("topk", "randomk"):
        k = math.ceil(float(spec.partition(":")[2]) * n)
        if name == "randomk":  # shared-index: a finiteness all-reduce, then the values
            return link.seconds("small", SMALL_BYTES) + link.seconds("all_reduce", 4.0 * k, calls) \
                + enc + dec, enc + dec
        wire = link.seconds("small", SMALL_BYTES) + link.seconds("all_gather", 8.0 * k + 4, calls)
        return wire + enc + w * dec, enc + w * dec
    payload = DENSE_BYTES[name] * n
    if w <= 2 or payload <= ALLGATHER_MAX_BYTES:  # allgather: W payloads decoded
        wire = link.seconds("small", SMALL_BYTES) + link.seconds("all_gather", payload, calls)
        return wire + enc + w * dec, enc + w * dec
    wire = link.seconds("all_to_all", payload, calls) + link.seconds("small", SMALL_BYTES) + \
        link.seconds("all_gather", payload / w, calls)  # two-phase
    return wire + enc * (1 + 1 / w) + 2 * dec, enc * (1 + 1 / w) + 2 * dec


def _buckets(mods: list, per_param: bool, first_mb: float = FIRST_BUCKET_MB,
             bucket_mb: float = BUCKET_MB) -> list[tuple[int, list, int]]:
    """pyfast.comm.buckets: (elements, [(n, matrix)], index of the module whose backward
    completes the bucket) in reduction order: parameters in reverse registration order."""
    flat = [(n, m, i) for i, (_, ps) in enumerate(mods) for n, m in ps]
    out, cur, size = [], [], 0.0
    for n, m, i in reversed(flat):
        if per_param:
            out.append((n, [(n, m)], i))
            continue
        cur.append((n, m, i))
        size += 4.0 * n
        if size >= (first_mb if not out else bucket_mb) * 2 ** 20:
            out.append((sum(x[0] for x in cur), [(x[0], x[1]) for x in cur], cur[-1][2]))
            cur, size = [], 0.0
    if cur:
        out.append((sum(x[0] for x in cur), [(x[0], x[1]) for x in cur], cur[-1][2]))
    return out


def _fifo(ready: list[float], cost: list[float]) -> float:
    """cost.predict_step's queue: op i starts when ready and the previous one is done."""
    end = 0.0
    for r, s in zip(ready, cost):
        end = max(r, end) + s
    return end


# ---------------------------------------------------------------- the step
def predict_time(shape: ModelShape, plan: Plan, work: Workload, cluster: Cluster) -> dict:
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
    tp_ar = tp_link.seconds("all_reduce", toks * shape.hidden * act,
                            calls=m * nblocks * (6 if ck else 4))
    tp_f = 2 * (tp_ar + tp_link.wake(bf / 2))   # attention's and the MLP's output, forward
    tp_b = 2 * (tp_ar + tp_link.wake(bb / 2))   # their inputs' gradients, backward
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
                elif plan.cp > 1:
                    ring = plan.cp_method != "ulysses"
                    hide = (mf * 0.3 if ring else 0.0)  # attention's share of the block
                    cpc += max(0.0, cp_f - hide) + max(0.0, cp_b - 2 * hide)
                    if plan.activation_checkpointing:
                        cpc += max(0.0, cp_f - hide)
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
        hop = pp_link.seconds("p2p", toks * shape.hidden * 4, 2 * m * v)
        # each rank waits on one receive per micro-batch (the first stage for gradients, the
        # last for activations; sends are isend), each transfer on the critical path once
        pp_c = m * v * (2 * hop + pp_link.wake((f + b) / (2 * v)))
        # a 1 KB header each way on the step's first message, and the step's outcome agreed by
        # one all-reduce (pyfast.parallel.p2p / Pipeline)
        pp_c += 2 * (pp_link.seconds("p2p", 1024) + pp_link.wake(f / v)) + \
            pp_link.seconds("small", SMALL_BYTES) + pp_link.wake(0.0)
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
    n_local = sum(n for _, ps in gmods for n, _ in ps)
    cal = cluster.calibration
    cont = cal.get("cpu_contention", 0.0)
    cpu_link = _cpu_link(cluster, world)
    if world > 1 and not plan.zero:
        per_param = plan.compress.partition(":")[0] in ("topk", "powersgd")
        bks = _buckets(gmods, per_param,
                       bucket_mb=NONE_BUCKET_MB if plan.compress == "none" else BUCKET_MB)
        cost, cdc = zip(*(_bucket_cost(plan.compress, bk, dp_link, cluster, len(bks))
                          for bk in bks))
        dp_c, codec = sum(cost), sum(cdc)
        if p > 1:  # reduce_gradients() after the pipeline: nothing to hide behind
            exposed_dp = dp_c
        else:  # the last micro-batch's backward, module by module from the head down
            start = body - b - r - (tpc + cpc) * (b + r) / max(f + b + r, 1e-30)
            done, t = {}, start
            for i in reversed(range(len(mods))):
                kf, kb, kr = mod_s(*mods[i])
                t += (kb + kr) * (1 + (tpc + cpc) / max(f + b + r, 1e-30))
                done[i] = t
            end = _fifo([done[i] for _, _, i in bks], cost)
            exposed_dp = max(0.0, end - body)
            # what the overlap cannot hide where the ranks fill the cores: the communication
            # thread's own CPU work (codec, gloo's copies at loopback speed)
            if cont:
                exposed_dp += cont * sum(_bucket_cost(plan.compress, bk, cpu_link, cluster)[0]
                                         for bk in bks)
        # then the side band's small all-reduce and the copy of the buckets into .grad
        copy = cal.get("copy_s_per_byte", 1.0 / cluster.gpu.hbm_bps)
        exposed_dp += dp_link.seconds("small", SMALL_BYTES) + dp_link.wake(bb) + \
            4.0 * n_local * copy * _compute_scale(cluster, plan)
    elif world > 1:
        zero_c, exposed_dp = _zero(plan, gmods, dp_link, cluster, body, mod_s, frozen)
        exposed_dp += dp_link.wake(bb)  # the step's wait for the last reduce-scatter
        if cont and plan.zero >= 2:
            zero_c_cpu, _ = _zero(plan, gmods, cpu_link, cluster, body, mod_s, frozen)
            exposed_dp += cont * zero_c_cpu
    # the step's small all-reduce (loss, norm, flag, bytes) over every rank, and the optimizer
    every = Link(cluster, plan.ranks, plan.ranks)
    small = every.seconds("small", 32.0) + every.wake(0.0)  # after the norm pass
    n_opt = n_local / world if plan.zero else n_local
    opt_rate = cluster.calibration.get("optim_s_per_param")
    optim = (opt_rate * n_opt if opt_rate is not None else 64.0 * n_opt / cluster.gpu.hbm_bps) \
        * _compute_scale(cluster, plan)
    optim += cal.get("step_overhead_s", 0.0) * _compute_scale(cluster, plan)  # the job's own
    step = body + exposed_dp + small + optim
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


def _cpu_link(cluster: Cluster, world: int) -> "Link":
    """The link whose seconds are a collective's CPU work (calibration's link_cpu)."""
    link = Link(cluster, 1, world)
    link.set_fit(cluster.calibration.get("link_cpu"))
    return link


def _bucket_cost(spec: str, bk, link: Link, cluster: Cluster,
                 calls: int = 1) -> tuple[float, float]:
    n, params, _ = bk
    if spec.partition(":")[0] in ("topk", "powersgd"):
        return reduction_s(spec, params[0][0], params[0][1], link, cluster, calls)
    return reduction_s(spec, n, (), link, cluster, calls)


def _trainable(shape: ModelShape, plan: Plan, mods: list, work: Workload):
    """A LoRA plan's modules as the reduction sees them: each block's adapters (A r x in,
    B out x r per adapted Linear), nothing elsewhere; and, the base sharded under ZeRO 3, each
    unit's frozen bytes in their stored format (None otherwise)."""
    from .finetune import REST, base_layer_bytes, head_weight_bytes
    r, tb = plan.lora, 4 if work.precision == "fp32" else 2
    ad = [x for i, o in shape.adapted_linears() for x in ((r * i, (r, i)), (o * r, (o, r)))]
    gmods = [(kind, ad if kind == "block" else []) for kind, _ in mods]
    if not (plan.zero == 3 and plan.base_placement == "shard"):
        return gmods, None
    # the head's weight as the job stores it (bf16 under bf16: head_weight_bytes), the rest REST
    hb = head_weight_bytes(work.precision)
    frozen = [base_layer_bytes(shape, plan.base_dtype, tb) if kind == "block" else
              sum((hb if kind == "head" and m else REST) * n for n, m in ps)
              for kind, ps in mods]
    return gmods, frozen


def _zero(plan: Plan, mods: list, link: Link, cluster: Cluster, body: float,
          mod_s, frozen: list | None = None) -> tuple[float, float]:
    """(comm seconds, exposed seconds) of ZeRO's reduce-scatters and parameter all-gathers.
    Reduce-scatter of n elements ~ an all-to-all of its (compressed) buffer; stage 3's
    all-gathers carry param_compress's payload, stages 1-2's exact fp32 after the step."""
    w = link.world
    name, _, arg = plan.compress.partition(":")
    if name == "powersgd":
        raise ValueError(f"--zero {plan.zero} with --compress {plan.compress}: the job's "
                         "reduce-scatter takes a compressor that works on a shard, not powersgd")
    # top-k/random-k select within each rank's segment: value + index per kept element
    gbytes = 4.0 if name == "none" else 8.0 * float(arg) if name in ("topk", "randomk") \
        else DENSE_BYTES[name]
    pbytes = 4.0 if plan.param_compress == "none" else DENSE_BYTES[plan.param_compress]

    def rs(n):
        enc, dec = _codec(plan.compress, n, cluster)
        return link.seconds("all_to_all", gbytes * n) + enc + dec

    def ag(n, by):
        enc, dec = _codec("none" if by == 4.0 else plan.param_compress, n / w, cluster)
        return link.seconds("all_gather", by * n / w) + enc + w * dec

    if plan.zero < 3:
        bks = _buckets(mods, False)
        red = [rs(n) for n, _, _ in bks]
        gat = sum(ag(n, 4.0) for n, _, _ in bks)
        if plan.zero == 1:  # at the step, after backward
            return sum(red) + gat, sum(red) + gat
        # stage 2: as DataParallel's buckets during the last backward (ready ~ evenly spread)
        bwd = [mod_s(k, ps) for k, ps in mods]
        tb = sum(x[1] + x[2] for x in bwd)
        t, done = body - tb, {}
        for i in reversed(range(len(mods))):
            t += bwd[i][1] + bwd[i][2]
            done[i] = t
        end = _fifo([done[i] for _, _, i in bks], red)
        return sum(red) + gat, max(0.0, end - body) + gat
    # stage 3: one unit per module; gathers one ahead of compute on the FIFO, forward and
    # backward, reduce-scatters behind each unit's backward
    units = [sum(n for n, _ in ps) for _, ps in mods]
    times = [mod_s(k, ps) for k, ps in mods]
    base = frozen or [0.0] * len(units)
    comm_free, t, total = 0.0, 0.0, 0.0
    for micro in range(plan.micro_batches):
        for order, phase in ((range(len(units)), 0), (reversed(range(len(units))), 1)):
            for i in order:
                g = ag(units[i], pbytes) + (link.seconds("all_gather", base[i] / w)
                                            if base[i] else 0.0)
                total += g
                comm_free = max(comm_free, t - (times[i - 1][phase] if i else 0.0)) + g
                # the unit waits on its gather's handle: a blocking wait after the last unit
                t = max(t, comm_free) + link.wake(times[i - 1][phase] if i else 0.0) + \
                    (times[i][0] if phase == 0 else times[i][1] + times[i][2])
                if phase == 1 and micro == plan.micro_batches - 1:
                    rsi = rs(units[i])
                    total += rsi
                    comm_free = max(comm_free, t) + rsi
    comp = plan.micro_batches * sum(x[0] + x[1] + x[2] for x in times)
    return total, max(0.0, max(t, comm_free) - comp)
