"""The gradient reduction of the time model (pyfast.plan.timing): compressors' error and wire
bytes, codec seconds, one all-reduce through a compressor, DataParallel's buckets and their
FIFO on the communication thread."""
from __future__ import annotations

import math
from functools import lru_cache

from .hardware import Cluster
from .sharding import BLOCKED, QUANT_BLOCK
from .spec import ModelShape, Plan, Workload
from .timing_link import SMALL_BYTES, Link

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
PER_PARAM = ("topk", "powersgd")  # DataParallel reduces these a parameter at a time (buckets)


def gathered_bytes(plan: Plan) -> float:
    """Bytes a parameter of ZeRO 3's all-gather carries (and, kept, holds): param_compress's
    payload, fp32 without one."""
    return 4.0 if plan.param_compress == "none" else DENSE_BYTES[plan.param_compress]


def rel_error(spec: str) -> float:
    name, _, arg = spec.partition(":")
    if name in ("topk", "randomk"):
        return math.sqrt(max(0.0, 1.0 - float(arg or 0.01)))
    if name not in REL_ERROR:
        raise ValueError(f"no relative error known for compressor {spec!r}")
    return REL_ERROR[name]


def steps_factor(spec: str) -> float:
    return 1.0 + STEPS_PER_ERROR * rel_error(spec)


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
                calls: int = 1, measured_calls: bool = True) -> tuple[float, float]:
    """(total, codec) seconds of one all_reduce of n elements through spec (cost.comm_seconds's
    algorithm: wire calls as collectives runs them, codec passes per algorithm).
    measured_calls=False: top-k's / PowerSGD's call from the link's fits even where
    reduce_seconds timed it (a link's extra over loopback where the job's own reduction was
    measured on loopback: timing's DataParallel probe)."""
    w = link.world
    name = spec.partition(":")[0]
    if name == "none":
        return link.seconds("all_reduce", 4.0 * n, calls), 0.0
    enc, dec = _codec(spec, n, cluster) if name != "powersgd" or mat else (0.0, 0.0)
    measured = (link.fit or {}).get("reduce", {}).get(spec) if w == 2 and measured_calls \
        else None
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


@lru_cache(maxsize=4096)
def _buckets(mods: tuple, per_param: bool, first_mb: float = FIRST_BUCKET_MB,
             bucket_mb: float = BUCKET_MB, align: int = 1) -> tuple[tuple[int, tuple, int], ...]:
    """pyfast.comm.buckets: (elements, ((n, matrix), ...), index of the module whose backward
    completes the bucket) in reduction order: parameters in reverse registration order, each
    starting at a multiple of `align` elements (no padding after a bucket's last one).
    mods: timing_compute._modules' tuples (cached here: one stage's buckets serve each of its
    plans)."""
    flat = [(n, m, i) for i, (_, ps) in enumerate(mods) for n, m in ps]
    out, cur, size = [], [], 0.0

    def close():
        padded = sum(-(-x[0] // align) * align for x in cur[:-1]) + cur[-1][0]
        out.append((padded, tuple((x[0], x[1]) for x in cur), cur[-1][2]))
    for n, m, i in reversed(flat):
        if per_param:
            out.append((n, ((n, m),), i))
            continue
        cur.append((n, m, i))
        size += 4.0 * -(-n // align) * align
        if size >= (first_mb if not out else bucket_mb) * 2 ** 20:
            close()
            cur, size = [], 0.0
    if cur:
        close()
    return tuple(out)


def dp_buckets(mods: tuple, compress: str) -> tuple[tuple[int, tuple, int], ...]:
    """DataParallel's buckets of these modules under `compress`, as pyfast.comm.buckets makes
    them: one a parameter for top-k / PowerSGD, else 25 MB for none (DDP's) and 4 MB for the
    rest, each parameter at a multiple of the compressor's block (sharding.QUANT_BLOCK), whose
    padding goes on the wire: gpt-tiny's int8 step put 295.8 KB on loopback against 269.4 KB
    for one flat all-reduce of its 132,864 elements (28 tensors, 19 of them vectors of
    64-256); 0.4% more elements on gpt-small."""
    name = compress.partition(":")[0]
    return _buckets(mods, name in PER_PARAM,
                    bucket_mb=NONE_BUCKET_MB if compress == "none" else BUCKET_MB,
                    align=QUANT_BLOCK if name in BLOCKED else 1)


def _fifo(ready: list[float], cost: list[float]) -> float:
    """cost.predict_step's queue: op i starts when ready and the previous one is done."""
    end = 0.0
    for r, s in zip(ready, cost):
        end = max(r, end) + s
    return end


def _bucket_cost(spec: str, bk, link: Link, cluster: Cluster, calls: int = 1,
                 measured_calls: bool = True) -> tuple[float, float]:
    n, params, _ = bk
    if spec.partition(":")[0] in PER_PARAM:
        return reduction_s(spec, params[0][0], params[0][1], link, cluster, calls,
                           measured_calls)
    return reduction_s(spec, n, (), link, cluster, calls)


def _trainable(shape: ModelShape, plan: Plan, mods: list, work: Workload):
    """A LoRA plan's modules as the reduction sees them: each block's adapters (A r x in,
    B out x r per adapted Linear), nothing elsewhere; and, the base sharded under ZeRO 3, each
    unit's frozen bytes in their stored format (None otherwise)."""
    from .finetune import REST, base_layer_bytes, head_weight_bytes
    r, tb = plan.lora, 4 if work.precision == "fp32" else 2
    ad = tuple(x for i, o in shape.adapted_linears() for x in ((r * i, (r, i)), (o * r, (o, r))))
    gmods = tuple((kind, ad if kind == "block" else ()) for kind, _ in mods)
    if not (plan.zero == 3 and plan.base_placement == "shard"):
        return gmods, None
    # the head's weight as the job stores it (bf16 under bf16: head_weight_bytes), the rest REST
    hb = head_weight_bytes(work.precision)
    frozen = [base_layer_bytes(shape, plan.base_dtype, tb) if kind == "block" else
              sum((hb if kind == "head" and m else REST) * n for n, m in ps)
              for kind, ps in mods]
    return gmods, frozen
