"""The cost model of a compressed gradient reduction: what a step costs on a given link, from
measured parts only (compute, the codec's own time on the tensor, the link's primitives).

    link = measure_link(group)                      # alpha + beta * bytes per primitive, fitted
    enc, dec = codec_seconds(c, bucket)             # this compressor on this tensor
    parts = comm_seconds(c, shape, world, link, (enc, dec))   # encode, wire, decode, total
    predict_step(compute_s, ready_s, [parts["total_s"], ...], tail_s)   # buckets in FIFO order

The algorithm of each reduction is the one pyfast.comm.collectives runs (and the native engine
mirrors), so the wire part is a sum of primitive calls: "native" one all-reduce of fp32;
"allgather" a size exchange + all-gather of the payload; "two-phase" all-to-all of the payload
+ size exchange + all-gather of one reduced chunk; "shared-index" a finiteness all-reduce + the
values' all-reduce; "sparse-allgather" as allgather; "powersgd" two all-reduces (P and Q) per
matrix. Codec passes per algorithm: allgather encodes once and decodes W payloads; two-phase
encodes the tensor and its reduced chunk and decodes twice over (W chunks of 1/W each time).

Each primitive is fitted on the live group (max over ranks: every rank predicts the same), so
a tc-shaped namespace, gloo's per-byte costs (all-gather is dearer than all-reduce on loopback:
../shared/MEASURED.md) and the per-call latency are all in the numbers. Not modelled: CPU
contention between the communication thread and compute on a machine with fewer cores than
ranks x threads (the report shows predicted next to measured, so it shows when it matters).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import pyfast.compress as C
from pyfast import _dist
from pyfast.perf import clock

PRIMITIVES = ("all_reduce", "all_gather", "all_to_all")
# 256 B and 256 KB .. 1 MB per rank: the small call gives the per-call latency (top-k and
# PowerSGD make 2 calls per parameter, ~50 a step on gpt-tiny), timed back to back as those calls
# run; the two large ones the per-byte slope (a step's buckets: gpt-tiny's whole gradient is
# 0.5 MB in bf16), and where that line meets the latency, the bytes a token-bucket link lets
# through at once after a pause.
SIZES = (1 << 8, 1 << 18, 1 << 20)
# A step sends its buckets after ~30 ms of compute, in which a tc token bucket refills (128 KB at
# 100 Mbit/s takes 10 ms): on a shaped link (pause=True) each large call waits as long first, or
# the fit would see an emptied bucket every time (measured, int8 at 100 Mbit/s: 20.6 ms
# predicted, 13 ms measured). Small calls never pause: after a sleep one took 1-3.6 ms against
# 0.4 ms back to back (the waking thread), and top-k's calls come back to back.
PAUSE_S = 0.02


@dataclass
class LinkModel:
    """seconds(prim, nbytes) = alpha + beta * max(0, nbytes - free) for each primitive, nbytes
    being what one rank contributes (all_reduce: its tensor; all_gather: its part; all_to_all:
    its whole send buffer), `free` the bytes that pass at once after a pause (a token bucket's
    burst; about 0 on an unshaped link); small_s: a few-element all-reduce (a size or flag
    exchange)."""
    fits: dict = field(default_factory=dict)
    small_s: float = 0.0

    def seconds(self, prim: str, nbytes: float) -> float:
        alpha, beta, free = self.fits[prim]
        return alpha + beta * max(0.0, nbytes - free)


def _time(fn, repeats: int, group, device, pause: float = 0.0) -> float:
    ts = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if pause:
            time.sleep(pause)
        t0 = clock(device)
        fn()
        ts.append(clock(device) - t0)
    return statistics.median(ts)


def _fit(xs, ys) -> tuple[float, float, float]:
    """(alpha, beta, free): alpha the smallest call's time, beta the slope of the two largest
    (>= 0: a negative slope is noise), free where that line falls to alpha."""
    alpha = ys[0]
    beta = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    free = max(0.0, xs[-1] - (ys[-1] - alpha) / beta) if beta > 0 else 0.0
    return alpha, beta, free


def measure_link(group=None, sizes=SIZES, repeats: int = 7, device=None,
                 pause: bool = False) -> LinkModel:
    """Fit each primitive on `group` (collective: every rank calls it; every rank gets the
    same model: the max over ranks of each timing), with tensors on `device` (default: the
    backend's). pause: the link is a token bucket (tc tbf) that refills between steps."""
    world = dist.get_world_size(group)
    if device is None:  # the group's backend's device: NCCL's current GPU, gloo's host
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(group) == "nccl" else torch.device("cpu"))  # cpu-literal: gloo
    times = []
    for prim in PRIMITIVES:
        for nbytes in sizes:
            x = torch.ones(nbytes, dtype=torch.uint8, device=device)
            if prim == "all_reduce":
                f = x.view(torch.float32)
                fn = lambda f=f: dist.all_reduce(f, group=group)  # noqa: E731
            elif prim == "all_gather":
                out = torch.empty(nbytes * world, dtype=torch.uint8, device=device)
                fn = lambda o=out, x=x: _dist.all_gather_single(o, x, group=group)  # noqa: E731
            else:
                out = torch.empty_like(x)
                fn = lambda o=out, x=x: dist.all_to_all_single(o, x, group=group)  # noqa: E731
            fn()  # warm: connections, buffers
            times.append(_time(fn, repeats, group, device,
                               PAUSE_S if pause and nbytes > sizes[0] else 0.0))
    small = torch.zeros(2, dtype=torch.int64, device=device)
    times.append(_time(lambda: dist.all_reduce(small, group=group), repeats, group, device))
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    t = t.tolist()
    k = len(sizes)
    fits = {p: _fit(list(sizes), t[i * k:(i + 1) * k]) for i, p in enumerate(PRIMITIVES)}
    return LinkModel(fits, t[-1])


def codec_seconds(c: C.Compressor, x: torch.Tensor, repeats: int = 3) -> tuple[float, float]:
    """(encode, decode) seconds of c on x, the fastest of `repeats` (after one warm call): the
    codec's own cost, error feedback included when c carries it. c's state moves (its feedback
    memory under the name "cost-probe"): pass a fresh instance to keep a live one untouched."""
    name = "cost-probe"
    c.decompress(c.compress(x, name))
    enc, dec = math.inf, math.inf
    for _ in range(repeats):
        t0 = clock(x.device)
        p = c.compress(x, name)
        t1 = clock(x.device)
        c.decompress(p)
        t2 = clock(x.device)
        enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
    return enc, dec


def _payload_bytes(c: C.Compressor, shape) -> int:
    """Bytes of c's payload for a tensor of `shape` (data-dependent sizes: a top-k payload's
    size is fixed by its ratio, so one compress of a random tensor gives it)."""
    n = math.prod(shape)
    w = c.wire_bytes(n)
    if w is not None:
        return w
    base = c.base
    return base.compress(torch.randn(n), "cost-size").nbytes


def _powersgd_elems(c: C.Compressor, shape) -> tuple[int, int] | None:
    """Elements of P and Q for a matrix, None when PowerSGD sends the tensor as it is."""
    base = c.base
    if not base.compressible(torch.empty(shape, device="meta")):
        return None
    rows = shape[0]
    cols = math.prod(shape[1:])
    r = min(base.rank, rows, cols)
    return rows * r, cols * r


def wire_calls(c: C.Compressor, shape, world: int) -> list[tuple[str, float]]:
    """The primitive calls (primitive, bytes one rank contributes) of one all_reduce of a
    tensor of `shape` through c, in the order collectives runs them."""
    n = math.prod(shape)
    algo = _algorithm(c, n, world)
    small = ("small", 16.0)
    if algo == "native":
        return [("all_reduce", 4.0 * n)]
    if algo in ("allgather", "sparse-allgather"):
        return [small, ("all_gather", float(_payload_bytes(c, shape)))]
    if algo == "two-phase":
        b = _payload_bytes(c, shape)
        return [("all_to_all", float(b)), small, ("all_gather", b / world)]
    if algo == "shared-index":
        return [small, ("all_reduce", float(_payload_bytes(c, shape)))]
    if algo == "powersgd":
        pq = _powersgd_elems(c, shape)
        if pq is None:
            return [("all_reduce", 4.0 * n)]
        return [("all_reduce", 4.0 * pq[0]), ("all_reduce", 4.0 * pq[1])]
    raise ValueError(f"no cost model for algorithm {algo!r}")


def _algorithm(c, n: int, world: int) -> str:
    from pyfast.comm.collectives import algorithm_for
    return algorithm_for(c, n, world)


def sent_bytes(c: C.Compressor, shape, world: int) -> int:
    """Bytes one rank sends for one all_reduce of `shape` through c (TCP headers aside): an
    all-reduce or all-to-all sends (W-1)/W of its buffer per phase (gloo's ring: 2 phases for
    an all-reduce), an all-gather its part to W-1 peers."""
    total = 0.0
    for prim, b in wire_calls(c, tuple(shape) if not isinstance(shape, int) else (shape,), world):
        if prim == "all_reduce":
            total += 2 * (world - 1) / world * b
        elif prim == "all_to_all":
            total += (world - 1) / world * b
        elif prim == "all_gather":
            total += (world - 1) * b
    return int(round(total))


def comm_seconds(c: C.Compressor, shape, world: int, link: LinkModel,
                 codec: tuple[float, float]) -> dict:
    """{"encode_s", "wire_s", "decode_s", "total_s"} of one all_reduce of `shape` through c,
    codec = codec_seconds(c, tensor of that shape)."""
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    n = math.prod(shape)
    algo = _algorithm(c, n, world)
    enc, dec = codec
    wire = sum(link.small_s if p == "small" else link.seconds(p, b)
               for p, b in wire_calls(c, shape, world))
    if algo == "native":
        enc = dec = 0.0
    elif algo in ("allgather", "sparse-allgather"):
        dec *= world  # every rank's payload decoded and summed
    elif algo == "two-phase":
        enc *= 1 + 1 / world  # the tensor, then the reduced chunk
        dec *= 2  # W chunks of 1/W, then the W reduced chunks
    return {"encode_s": enc, "wire_s": wire, "decode_s": dec, "total_s": enc + wire + dec}


def predict_step(compute_s: float, ready_s, bucket_s, tail_s: float = 0.0) -> dict:
    """The step with buckets reduced in order on one communication thread: bucket i starts when
    its gradients are ready (ready_s[i], seconds after the step began) and the previous one is
    done, and the step ends when backward (compute_s) and the last bucket are both done, then
    the tail (optimizer, small all-reduces). {"step_s", "exposed_s", "comm_s"}."""
    end = 0.0
    for r, s in zip(ready_s, bucket_s):
        end = max(r, end) + s
    body = max(compute_s, end)
    return {"step_s": body + tail_s, "exposed_s": body - compute_s, "comm_s": float(sum(bucket_s))}


# Extra steps to a target loss per unit of a compressor's relative error ||D(C(g)) - g|| / ||g||
# on the gradient, error feedback on: gpt-tiny (ablation, bench/results/ablate) needed 115 steps
# with int4 (error 0.14-0.19 on its gradients) against 106 with bf16, int8 (0.012-0.014) and
# fp8 (0.026): +8.5% for ~0.165, so 0.5. One model's number: a first-order stand-in that keeps a
# coarse quantizer from winning on step time what it loses in steps.
STEPS_PER_ERROR = 0.5


def relative_error(c: C.Compressor, x: torch.Tensor) -> float:
    """||decompress(compress(x)) - x|| / ||x|| (0 for a zero x), c's own error without feedback."""
    base = c.base
    y = base.decompress(base.compress(x, "cost-error")).reshape(x.shape).to(torch.float32)
    norm = float(x.float().norm())
    return float((y - x.float()).norm()) / norm if norm > 0 else 0.0


def convergence_seconds(error: float, step_s: float, share: float = 1.0) -> float:
    """Seconds a step effectively costs in extra steps to the target: STEPS_PER_ERROR * error of
    a step of step_s, for the `share` of the gradient this compressor carries."""
    return STEPS_PER_ERROR * error * step_s * share

