"""Compressed collectives over torch.distributed (the Python reference path).

Every rank ends with bit-identical results: each output element is produced by decoding the
same bytes in the same rank order with the same arithmetic on every rank. Algorithms:

- none: the backend's all-reduce.
- fp16 / bf16 / int8 / int4 / fp8 / sign, "two-phase": all-to-all of compressed chunks, each
  rank decodes and sums its chunk in fp32, compresses the sum again, all-gather. Per-rank wire
  about 2(W-1)/W times the compressed size, like a ring all-reduce but compressed.
  "allgather": every rank gathers every compressed tensor and sums in rank order: one
  compression instead of two (less error), (W-1) times the compressed size per rank; at W=2
  the wire is the same as two-phase, so it is chosen there and for small tensors.
- topk: all-gather of sparse payloads (counts first; a NaN/Inf flag rides with them so every
  rank raises the same error).
- randomk: indices come from a shared seed, so the values are all-reduced directly.
- powersgd: all-reduce P, orthonormalize, all-reduce Q.

Devices: every buffer here (received bytes, fp32 sums, the counts and NaN/Inf flags that go
first) is allocated on the device of the tensor it serves, so a CUDA gradient never meets a
host buffer; the group must have a CUDA backend other than gloo for it (check_backend): gloo
would copy through the host behind the caller's back. The host reads only the scalars it must
branch on: the gathered sizes and flags (_all_gather_var), the finiteness flags, each one sync
of a few bytes. A backend failure (a dead peer, the
group's timeout) surfaces as failure.CommError naming the reduction, e.g. "all_reduce of
bucket3 (int8, two-phase) failed on rank 1: ...".
"""
from __future__ import annotations


import contextlib
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pyfast import _dist
from pyfast._ranges import ranged
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import pyfast.compress as C
from pyfast.comm import pipelined
from pyfast.comm.dry import read
from pyfast.comm.failure import naming
from pyfast.errors import NonFiniteGradient  # raised where found (ops, compress); re-exported
from pyfast.perf import clock

# Below 256 KB of compressed payload the second compression and the extra round of two-phase
# cost more than the (W-2)/W bytes they save (latency-bound regime).
ALLGATHER_MAX_BYTES = 256 * 1024
OPS = ("sum", "avg")


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def device_backends(config: str) -> dict[str, str]:
    """dist.get_backend_config's "cpu:gloo,cuda:nccl" (or a bare "gloo": every device) ->
    {device type: backend name}."""
    pairs = [item.split(":", 1) for item in config.lower().split(",") if item.strip()]
    if len(pairs) == 1 and len(pairs[0]) == 1:
        return {"*": pairs[0][0].strip()}
    return {dev.strip(): name.strip() for dev, name in pairs}


def check_backend(device: torch.device, group=None, what: str = "a collective") -> None:
    """CUDA tensors go through the group's CUDA backend (NCCL), never gloo: a gloo group
    accepts CUDA tensors by staging them through host memory, a copy no caller asked for.
    Raise ValueError naming the fix instead. Other devices pass: their backend is the caller's."""
    if device.type != "cuda":
        return
    found = device_backends(dist.get_backend_config(group))
    backend = found.get("cuda", found.get("*"))
    if backend is None or backend == "gloo":
        config = dist.get_backend_config(group)
        raise ValueError(f"{what}: a tensor on {device} needs a process group with a CUDA backend "
                         f"(NCCL), but the group's backends are {config!r}: "
                         "gloo would copy it through the host. Make the group with "
                         'backend="nccl" (or "cpu:gloo,cuda:nccl"), or move the tensor to the CPU')


def _label(name: str, t: torch.Tensor) -> str:
    """How errors name the reduced tensor: its name, or its size and dtype."""
    return name or f"a {t.numel()}-element {str(t.dtype).replace('torch.', '')} tensor"


def _chunks(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` chunks of n elements, starts aligned to `align`."""
    per = -(-n // parts)
    per = -(-per // align) * align
    return [(min(n, i * per), min(n, (i + 1) * per)) for i in range(parts)]


@ranged("pyfast.codec.compress")
def _bytes(c: C.Compressor, x: torch.Tensor, name: str) -> torch.Tensor:
    return c.to_wire(c.compress(x, name))


@ranged("pyfast.codec.decode")
def _decode_add(c: C.Compressor, buf: torch.Tensor, out: torch.Tensor, dtype) -> None:
    c.decode_add(c.from_wire(buf, out.shape, dtype), out)  # fused or sparse where it can be


def _all_gather_var(buf: torch.Tensor, group, flag: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    """All-gather byte buffers of different sizes: sizes (and a flag) first, then padded data.
    The sizes travel on buf's device too: the group's backend for that device carries them."""
    world, _ = _world(group)
    meta = torch.tensor([buf.numel(), flag], dtype=torch.int64, device=buf.device)
    metas = meta.new_empty(world * 2)
    _dist.all_gather_single(metas, meta, group=group)
    every = read(metas, [buf.numel(), flag] * world, group)  # a dry run: every rank is this one
    sizes, flags = every[0::2], every[1::2]
    if any(flags):
        return [], flags
    pad = max(sizes)
    padded = buf.new_zeros(pad)
    padded[: buf.numel()] = buf
    out = list(buf.new_empty(world, pad).unbind())
    dist.all_gather(out, padded, group=group)
    return [o[:s] for o, s in zip(out, sizes)], flags


def _two_phase(x: torch.Tensor, c, group, name: str) -> torch.Tensor:
    world, rank = _world(group)
    n = x.numel()
    bounds = _chunks(n, world, c.align)
    send = [_bytes(c, x[a:b], f"{name}.{i}") for i, (a, b) in enumerate(bounds)]
    sizes = [s.numel() for s in send]  # every rank's chunk i has the same layout and size
    mine = bounds[rank]
    recv = torch.empty(sizes[rank] * world, dtype=torch.uint8, device=x.device)
    dist.all_to_all_single(recv, torch.cat(send), [sizes[rank]] * world, sizes, group=group)
    acc = torch.zeros(mine[1] - mine[0], dtype=torch.float32, device=x.device)
    for buf in recv.split(sizes[rank]):
        _decode_add(c, buf, acc, x.dtype)
    reduced = _bytes(c, acc.to(x.dtype), f"{name}.sum")
    gathered, _ = _all_gather_var(reduced, group)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    for (a, b), buf in zip(bounds, gathered):
        out[a:b] = c.decompress(c.from_wire(buf, (b - a,), x.dtype)).to(torch.float32)
    return out


def _gather_checked(x: torch.Tensor, c, group, name: str) -> list[torch.Tensor]:
    """Every rank's compressed x; a NaN/Inf refusal on any rank is raised on every rank."""
    flag = 0
    try:
        buf = _bytes(c, x, name)
    except NonFiniteGradient:  # top-k refuses NaN/Inf: tell every rank before anyone raises
        buf, flag = torch.empty(0, dtype=torch.uint8, device=x.device), 1
    gathered, flags = _all_gather_var(buf, group, flag)
    _refuse_nonfinite(flags, name)
    return gathered


def _refuse_nonfinite(flags: list, name: str) -> None:
    """Every rank raises the same error when any rank's flag is set."""
    if any(flags):
        bad = [r for r, f in enumerate(flags) if f]
        raise NonFiniteGradient(f"{name or 'tensor'}: NaN/Inf gradient on rank(s) {bad}")


def _gather_sum(x: torch.Tensor, c, group, name: str) -> torch.Tensor:
    """All-gather compressed tensors, sum in rank order (same bytes, same order everywhere)."""
    out = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
    for buf in _gather_checked(x, c, group, name):
        _decode_add(c, buf, out, x.dtype)
    return out


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in t. min and max propagate NaN and show an Inf: one pass, no temporary.
    9.4M fp32 on one core of this 2-core EPYC: 1.6 ms, against 49 ms for
    torch.isfinite(t).all() (a 9.4 MB bool tensor, page faults included), which stood between
    the last reduction and the return of backward in `pyfast bench dp` (35-50 ms a step)."""
    if t.numel() == 0 or t.is_meta:  # a dry run's meta tensors hold no values: taken as finite
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


def _agree_finite(x: torch.Tensor, group, name: str) -> None:
    """RandomK refuses NaN/Inf; refusing on one rank only would leave the others waiting in the
    all-reduce (and their seed counters a step ahead). Agree first, with one tiny all-reduce,
    before any compressor state moves."""
    world, rank = _world(group)
    flags = torch.zeros(world, device=x.device)  # on x's device: its backend carries it
    mine = float(not all_finite(x))
    flags[rank] = mine
    dist.all_reduce(flags, group=group)
    every = read(flags, [mine] * world, group)  # a dry run: every rank is this one
    if any(every):
        bad = [r for r, f in enumerate(every) if f]
        raise NonFiniteGradient(f"{name or 'tensor'}: NaN/Inf gradient on rank(s) {bad}")


def _randomk(x: torch.Tensor, c, group, name: str) -> torch.Tensor:
    _agree_finite(x, group, name)
    p = c.compress(x, name)  # same seed on every rank -> same indices
    values = p.tensors["values"].to(torch.float32)
    dist.all_reduce(values, group=group)
    p.tensors["values"] = values
    p.dtype = torch.float32
    return c.base.decompress(p).reshape(-1)


def _powersgd(t: torch.Tensor, c, group, name: str) -> torch.Tensor:
    base = c.base
    if not base.compressible(t):
        out = t.reshape(-1).to(torch.float32)
        dist.all_reduce(out, group=group)
        return out
    m = t.reshape(t.shape[0], -1).to(torch.float32)
    ef = c.feedback._buffer(t, name) if c.feedback is not None else None
    if ef is not None:
        m = m + ef.view(m.shape)
    p = base.p_step(m, name)
    dist.all_reduce(p, group=group)
    q = base.q_step(m, p, name)  # orthonormalizes p in place: same input, same result everywhere
    if ef is not None:  # what this rank's projection missed: sum over ranks of P q_r^T = P Q^T
        ef.copy_((m - p @ q.t()).reshape(-1))
    dist.all_reduce(q, group=group)
    if base.warm_start:
        base.q[name] = q.clone()
    return (p @ q.t()).reshape(-1)


def choose(c: C.Compressor, numel: int, world: int) -> str:
    """The algorithm for reducing numel elements through c over world ranks: what c declares
    (Compressor.algorithm), and for "dense" the cheaper of allgather and two-phase."""
    algo = c.algorithm  # error feedback does not change it: WithFeedback reports its inner one's
    if algo == "dense":
        small = c.wire_bytes(numel) <= ALLGATHER_MAX_BYTES
        return "allgather" if world <= 2 or small else "two-phase"
    if algo in ("native", "sparse-allgather", "shared-index", "powersgd"):
        return algo
    raise TypeError(f"no collective algorithm for compressor {c!r} (its algorithm: {algo!r})")


def algorithm_for(c: C.Compressor, numel: int, world: int, algo: str | None = None) -> str:
    """choose(c, numel, world), or the caller's `algo` if c can run it (the dense compressors
    run either of "two-phase" and "allgather"); ValueError otherwise."""
    auto = choose(c, numel, world)
    if algo is None:
        return auto
    if algo != auto and not {algo, auto} <= {"two-phase", "allgather"}:
        raise ValueError(f"{c.spec} cannot use algorithm {algo!r} (it uses {auto!r}; the dense "
                         "quantizers and casts choose between 'two-phase' and 'allgather')")
    return algo


@ranged("pyfast.comm.all_reduce")
def _reduce(t: torch.Tensor, c, group, op: str, name: str, algo: str | None) -> torch.Tensor:
    world, _ = _world(group)
    algo = algorithm_for(c, t.numel(), world, algo)
    with naming(f"all_reduce of {_label(name, t)} ({c.spec}, {algo})"):
        return _run(t, c, group, op, name, algo, world)


def _run(t: torch.Tensor, c, group, op: str, name: str, algo: str, world: int) -> torch.Tensor:
    if algo == "native" and t.dtype == torch.float32 and t.is_contiguous():
        dist.all_reduce(t, group=group)  # in place, no copies
        return t.div_(world) if op == "avg" else t
    if algo == "native":
        out = t.reshape(-1).to(torch.float32, copy=True)
        dist.all_reduce(out, group=group)
    elif algo == "powersgd":
        out = _powersgd(t, c, group, name)
    elif algo == "shared-index" and t.dtype == torch.float32 and t.is_contiguous():
        _agree_finite(t, group, name)
        p = c.compress(t.view(-1), name)  # same seed on every rank -> same indices
        values = p.tensors["values"].to(torch.float32)
        dist.all_reduce(values, group=group)
        idx = c.base.indices(t.numel(), p.meta["seed"], t.device).long()
        flat = t.view(-1).zero_()  # existing memory: 1.9 ms; fresh 64 MB zeros: 29 ms
        flat.index_put_((idx,), values)
        return t.div_(world) if op == "avg" else t
    elif algo in ("allgather", "sparse-allgather", "two-phase") and fast_path(t):
        flat = t.view(-1)
        fn = pipelined.two_phase_into if algo == "two-phase" else pipelined.gather_sum_into
        fn(flat, c, group, name, flat, _HELPERS)
        return t.div_(world) if op == "avg" else t
    else:
        x = t.reshape(-1)
        fn = {"two-phase": _two_phase, "allgather": _gather_sum,
              "sparse-allgather": _gather_sum, "shared-index": _randomk}[algo]
        out = fn(x, c, group, name)
    if op == "avg":
        out = out / world
    with torch.no_grad():
        t.copy_(out.view(t.shape))
    return t


def wait_all(handles) -> None:
    """Wait for every handle, then raise the first error: never leave a reduction running
    behind the caller's back (its next collective would interleave with it)."""
    errors = []
    for h in handles:
        try:
            h.wait()
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]


def fast_path(t: torch.Tensor) -> bool:
    """In-place pipelined path (pipelined.py) unless PYFAST_COMM_REFERENCE=1 asks for the
    reference functions above (tests compare the two)."""
    return (t.dtype == torch.float32 and t.is_contiguous()
            and os.environ.get("PYFAST_COMM_REFERENCE") != "1")


_HELPERS = SimpleNamespace(decode_add=_decode_add, to_bytes=_bytes, chunks=_chunks,
                           gather_checked=_gather_checked, refuse_nonfinite=_refuse_nonfinite)


class Handle:
    """Asynchronous work, whoever runs it (this module's FIFO worker, the native engine, several
    handles at once): wait() blocks until the work is done and returns its result, or raises its
    error (the same one at every call); `seconds` is how long the work itself took where it ran
    (what compressor="auto" measures), NaN while unknown or if it failed.

    `join(timeout)` blocks and returns (result, seconds), raising the work's error (a timeout
    raises TimeoutError and leaves the work pending); `progress()` is `seconds` before join
    returned, and `done()` whether the work has finished."""

    def __init__(self, join, progress=None, done=None):
        self._join, self._progress, self._done = join, progress, done
        self._out: tuple | None = None
        self._error: BaseException | None = None

    @ranged("pyfast.comm.wait")
    def wait(self, timeout: float | None = None):
        if self._error is not None:
            raise self._error
        if self._out is None:
            try:
                self._out = self._join(timeout)
            except TimeoutError:
                raise
            except BaseException as e:  # surfaced here, on the caller's thread
                self._error = e
                raise
        return self._out[0]

    @property
    def seconds(self) -> float:
        if self._out is not None:
            return self._out[1]
        if self._error is None and self._progress is not None:
            return self._progress()
        return float("nan")

    def is_completed(self) -> bool:
        if self._out is not None or self._error is not None:
            return True
        return bool(self._done and self._done())

    @classmethod
    def on_worker(cls, fn, *args, executor: ThreadPoolExecutor | None = None) -> "Handle":
        """fn(*args) on the FIFO communication thread, timed there, the device of its first
        tensor argument synchronized at both ends (perf.clock: on CUDA the time then also holds
        device work the caller queued meanwhile, an upper bound; without it, the launch).
        executor: a caller's own single-thread FIFO instead (DiLoCo's outer all-reduce runs for
        tau inner steps and must not hold up DataParallel's buckets queued on the shared one)."""
        took: list[float] = []
        device = next((a.device for a in args if hasattr(a, "device")), None)
        # the caller's dispatch modes watch the worker's ops too (a dry run's accounting and
        # error naming, pyfast.train.dryrun); none in a normal run
        modes = _get_current_dispatch_mode_stack()

        inline = any(getattr(m, "comm_inline", False) for m in modes)

        def timed():
            with contextlib.ExitStack() as stack:
                for m in () if inline else modes:  # inline: active on this thread already
                    stack.enter_context(m)
                t0 = clock(device)
                result = fn(*args)
                took.append(clock(device) - t0)
            return result
        if inline:
            # a dry run (pyfast.train.dryrun): the work here, now, in issue order. Its peak
            # memory then does not depend on when a thread ran: threaded, gpt ZeRO-2's varied
            # by 0.66-2.6 MB of 25 between two runs of the same step.
            fut = Future()
            try:
                fut.set_result(timed())
            except BaseException as e:  # noqa: BLE001  (raised by wait(), as from the worker)
                fut.set_exception(e)
        else:
            fut = (executor or _executor()).submit(timed)
        h = cls(lambda timeout: (fut.result(timeout), took[0]),
                lambda: took[0] if took else float("nan"), fut.done)
        h.future = fut  # add_done_callback: run something on the worker once it is done
        return h

    @classmethod
    def of_all(cls, handles) -> "Handle":
        """One handle for several: wait() waits for every one (wait_all) and returns their
        results; `seconds` is their sum (they ran one after another)."""
        handles = list(handles)

        def join(timeout):
            wait_all(handles)
            return [h.wait() for h in handles], sum(h.seconds for h in handles)
        return cls(join, lambda: sum(h.seconds for h in handles),
                   lambda: all(h.is_completed() for h in handles))


def all_reduce(t: torch.Tensor, compressor=None, group=None, op: str = "sum",
               async_op: bool = False, name: str = "", algorithm: str | None = None):
    """Reduce t across the group in place, through `compressor` (None, a spec or a
    Compressor). Returns t, or a handle whose wait() returns t when async_op. `name` keys
    per-tensor compressor state (shared seeds, warm starts); `algorithm` overrides the choice
    between "two-phase" and "allgather" for the dense compressors."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"all_reduce takes float32, bfloat16 or float16 tensors, got {t.dtype}")
    c = C.get(compressor)
    check_backend(t.device, group, f"all_reduce of {_label(name, t)}")
    if not async_op:
        return _reduce(t, c, group, op, name, algorithm)
    return Handle.on_worker(_reduce, t, c, group, op, name, algorithm)


@ranged("pyfast.comm.all_reduce")
def sum_async(t: torch.Tensor, group=None, name: str = "") -> Handle:
    """Sum t (fp32, contiguous: the backend's own all-reduce, nothing encoded) over the group in
    place, issued to the backend now from the caller's thread, as DDP's reducer issues its
    buckets, not through a FIFO worker: gloo runs two collectives at once on its two worker
    threads (NCCL queues them on its stream). Measured (2 ranks x 1 thread on this 2-core EPYC,
    loopback, issue 32): all-reducing gpt-small's last two buckets (28 and 12 MB) took 71 ms one
    after the other, 54 ms issued together; the 28 MB alone 50. Every collective on `group` must
    then be issued from the caller's thread (or be done): one queued on the FIFO worker could
    be issued before this one on one rank and after it on another. wait() raises a backend
    failure as CommError naming the tensor; `seconds`: from the issue to the backend's
    completion callback (its future)."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"sum_async takes a contiguous float32 tensor, got {t.dtype} "
                         f"(contiguous: {t.is_contiguous()})")
    what = f"all_reduce of {_label(name, t)} (none, native)"
    check_backend(t.device, group, what)
    took: list[float] = []
    t0 = time.perf_counter()
    with naming(what):
        work = dist.all_reduce(t, group=group, async_op=True)
    work.get_future().add_done_callback(lambda _: took.append(time.perf_counter() - t0))

    def join(timeout):
        if timeout is not None:
            raise ValueError("sum_async's handles wait without a timeout (the group's applies)")
        with naming(what):
            work.wait()
        return t, took[0] if took else time.perf_counter() - t0
    return Handle(join, lambda: took[0] if took else float("nan"), work.is_completed)


def all_reduce_pieces(flat: torch.Tensor, pieces, compressor=None, group=None, op: str = "sum",
                      name: str = "") -> Handle:
    """Reduce each piece of `flat` alone, asynchronously, in order: pieces are (key, offset,
    shape), the view flat[offset:offset + numel].view(shape) reduced under f"{name}.{key}" (the
    name its compressor state, error feedback included, is kept under). For compressors that
    work per tensor (Compressor.per_tensor: a matrix to factor, a selection): no piece's result
    depends on its neighbours. One handle for all of them (Handle.of_all)."""
    c = C.get(compressor)
    return Handle.of_all(
        all_reduce(flat[o:o + math.prod(shape)].view(shape), c, group, op=op, async_op=True,
                   name=f"{name}.{key}")
        for key, o, shape in pieces)


_EXEC: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    # One worker: collectives must be issued in the same order on every rank, so async calls
    # run strictly first-in first-out, never concurrently.
    global _EXEC
    if _EXEC is None:
        _EXEC = ThreadPoolExecutor(1, thread_name_prefix="pyfast-comm")
    return _EXEC
