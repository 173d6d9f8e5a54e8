"""Asynchronous tensor parallelism: sequence-parallel matmuls with their communication overlapped.

    all_gather_linear(x, w, b)     = F.linear(all_gather(x along dim), w, b)   column-parallel in
    linear_reduce_scatter(x, w, b) = reduce_scatter(F.linear(x, w) along dim) + b  row-parallel out

The first sends pieces of its rows to the other ranks, multiplies its own, then each piece as it
lands; the second multiplies a piece of every rank's rows, sends it and multiplies the next; each
is the other's backward. torch's fused_all_gather_matmul does it on NVLink GPUs, not on gloo.

Results equal the non-overlapped tp_comm path bit for bit (MIN_ROWS; weight and bias gradients
on F.linear's own layout; a sum of 2 ranks is a + b either way); beyond 2 ranks partial sums are
added in rank order, gloo's in its ring's order: a few ulps apart.

comm moves the bytes: "c10d" (isend/irecv, default), a NativeEngine (pyfast.comm.engine; fp32) or
an object with C10dComm's interface. Not async collectives: at 1 Gbit/s (bench/results/overlap_tp)
the all-gather is as fast (36.8 vs 37.9 ms), gloo's reduce_scatter is an all-reduce (43.8 vs 77.1).

Under autocast both compute what F.linear does there: x, weight and bias cast to the autocast
dtype, the GEMMs in it (torch.mm(out=) alone would ignore autocast and run in fp32).
Failures: timeout= bounds every wait on a piece (gloo enforces it in its transport, so a
silent peer fails the call instead of hanging); a failed transfer raises CommError naming the
function and direction (with a layer's CommGuard: the layer, which it then breaks).
"""
import datetime
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from pyfast.comm.agree import agree
from pyfast.comm.failure import as_timedelta
from pyfast.ops.linear import autocast_linear_args
from pyfast.parallel.tp_comm import CommGuard, tp_world

# MKL sgemm (2024.2, AVX-512) gives a row the same bits in any GEMM of >= 4 rows, not of 1-3 (8e-5
# apart at K = 1024): pieces keep MIN_ROWS rows (`pieces` is a maximum), smaller shards one GEMM.
MIN_ROWS = 4
TAG = 0x7470  # p2p tag ("tp"): never matched with pipeline-parallel transfers


def _row_ranges(rows, pieces):  # [a, e) row ranges
    n = max(1, min(pieces, rows // MIN_ROWS))  # sizes differ by at most one row
    return [(i * rows // n, (i + 1) * rows // n) for i in range(n)]


class C10dComm:
    """A launcher: world, rank, peers (the others); all_gather(outs, x): outs[q] <- rank q's x;
    reduce_scatter(out, parts [world, rows, cols]): out <- sum of every rank's parts[rank]; both
    return a function that waits. isend/irecv: pieces land in order, in the caller's buffers."""

    def __init__(self, group, timeout: datetime.timedelta | None = None):
        self.group, (self.world, self.rank) = group, tp_world(group)
        self.peers = [(self.rank + s) % self.world for s in range(1, self.world)]
        self.timeout = timeout  # of each wait; None: the group's own

    def _swap(self, send, recv, tag=TAG):  # lists of (tensor, peer); sends kept until waited on
        # One batch: each rank sends to and receives from every peer at once, which NCCL can
        # only do grouped (else two large sends to each other deadlock). Every piece goes to a
        # peer in the order its receive is posted there, so nothing relies on the tag.
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=q, tag=tag)
               for t, q in send]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=q, tag=tag)
                for t, q in recv]
        works = dist.batch_isend_irecv(ops) if ops else []
        if self.timeout is None:
            return lambda: [w.wait() for w in works]
        return lambda: [w.wait(self.timeout) for w in works]

    def all_gather(self, outs, x):
        return self._swap([(x, q) for q in self.peers], [(outs[q], q) for q in self.peers])

    def reduce_scatter(self, out, parts):
        got = torch.empty_like(parts)
        wait = self._swap([(parts[q], q) for q in self.peers], [(got[q], q) for q in self.peers])

        def add():
            wait()
            for q in range(self.world):  # in rank order, as the engine adds
                p = parts[q] if q == self.rank else got[q]
                out.copy_(p) if q == 0 else out.add_(p)
        return add


class EngineComm:
    """The launcher on a NativeEngine's thread (made with NativeEngine.private(group))."""

    def __init__(self, engine, group):
        if dist.get_process_group_ranks(engine.group) != dist.get_process_group_ranks(group):
            raise ValueError("the engine's ranks are not the group's: NativeEngine.private(group)")
        self.engine, self.world, self.rank = engine, engine.world, engine.rank
        self.peers = [(self.rank + s) % self.world for s in range(1, self.world)]

    def all_gather(self, outs, x):
        tmp = x.new_empty((self.world,) + tuple(x.shape))
        done = self.engine.all_gather_into(tmp, x).wait
        return lambda: [done()] + [outs[q].copy_(tmp[q]) for q in self.peers]

    def reduce_scatter(self, out, parts):
        return self.engine.reduce_scatter_into(out, parts).wait


def launcher(comm, group, timeout=None):
    """The launcher for `comm` on `group`: "c10d", a NativeEngine, or a launcher object."""
    from pyfast.comm.engine import NativeEngine
    if comm == "c10d":
        return C10dComm(group, timeout)
    comm = EngineComm(comm, group) if isinstance(comm, NativeEngine) else comm
    if isinstance(comm, str) or comm.world != tp_world(group)[0]:
        raise ValueError(f"comm must be 'c10d', a NativeEngine (NativeEngine.private(group)) or "
                         f"a launcher, on the group's {tp_world(group)[0]} ranks; got {comm!r}")
    return comm


def _mm(a, b, bias, out):  # addmm(bias, x, w.t()) is F.linear's own call: same kernel
    return torch.mm(a, b, out=out) if bias is None else torch.addmm(bias, a, b, out=out)


def all_gather_mm(x, b, bias, comm, pieces):
    """(all_gather(x) @ b + bias, all_gather(x)) for x [R, K] this rank's rows, b [K, N]."""
    W, R = comm.world, x.shape[0]
    full, y = x.new_empty(W * R, x.shape[1]), x.new_empty(W * R, b.shape[1])
    at = lambda q, a, e: slice(q * R + a, q * R + e)  # noqa: E731  rows a:e of rank q's block
    ranges = _row_ranges(R, pieces)  # [(0, R)] below MIN_ROWS
    works = [comm.all_gather([full[at(q, a, e)] for q in range(W)], x[a:e]) for a, e in ranges]
    full[at(comm.rank, 0, R)] = x  # once the sends are posted: the link starts first
    if R < MIN_ROWS:  # one GEMM over all rows: the reference's kernel
        works[0]()
        return _mm(full, b, bias, y), full
    _mm(x, b, bias, y[at(comm.rank, 0, R)])  # own rows while the others travel
    for (a, e), wait in zip(ranges, works):
        wait()
        for q in comm.peers:
            _mm(full[at(q, a, e)], b, bias, y[at(q, a, e)])
    return y, full


def mm_reduce_scatter(x, b, comm, pieces):
    """reduce_scatter(x @ b), x [W * R, K], b [K, N], as finish() -> [R, N]: the last pieces
    travel until it is called, behind whatever the caller computes first."""
    W, R, N = comm.world, x.shape[0] // comm.world, b.shape[1]
    out, blocks = x.new_empty(R, N), x.view(W, R, -1)
    works = [comm.reduce_scatter(out, torch.mm(x, b).view(W, R, N))] if R < MIN_ROWS else []
    for a, e in _row_ranges(R, pieces) if R >= MIN_ROWS else []:
        part = x.new_empty(W, e - a, N)
        for q in comm.peers + [comm.rank]:  # own rows last: they need not travel
            torch.mm(blocks[q, a:e], b, out=part[q])
        works.append(comm.reduce_scatter(out[a:e], part))

    def finish():
        for wait in works:
            wait()
        return out
    return finish


def _rows(t, dim):  # `dim` moved to the front, as a contiguous [rows, features] matrix
    return t.movedim(dim, 0).reshape(-1, t.shape[-1]).contiguous()


def _unrows(m, like, dim, seq):  # _rows undone: m in like's layout, seq long along dim
    front = m.view([seq] + [s for i, s in enumerate(like[:-1]) if i != dim] + [m.shape[-1]])
    return front.movedim(0, dim).contiguous() if dim else front


def _linear_grads(gy, x, want_w, want_b):  # F.linear's, on its layout: rows summed in its order
    g2 = gy.reshape(-1, gy.shape[-1])
    return (g2.t().mm(x.reshape(-1, x.shape[-1])) if want_w else None,
            g2.sum(0) if want_b else None)


class _AllGatherLinear(Function):
    """Backward: grad x = the overlapped reduce-scatter of grad_y @ w, grad w and b computed
    while its last pieces travel. Keeps the gathered x (world x the shard) for grad w, as gather
    + F.linear does: gathering it again would trade that memory for one more all-gather."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, dim, pieces, guard):
        with guard("forward all-gather (all_gather_linear)"):
            y, full = all_gather_mm(_rows(x, dim), weight.t(), bias, comm, pieces)
        seq = comm.world * x.shape[dim]
        ctx.save_for_backward(_unrows(full, x.shape, dim, seq), weight)
        ctx.comm, ctx.dim, ctx.pieces, ctx.shape, ctx.guard = comm, dim, pieces, x.shape, guard
        return _unrows(y, x.shape, dim, seq)

    @staticmethod
    def backward(ctx, gy):
        (full, weight), need = ctx.saved_tensors, ctx.needs_input_grad
        with ctx.guard("backward reduce-scatter (all_gather_linear)"):
            if need[0]:
                finish = mm_reduce_scatter(_rows(gy, ctx.dim), weight, ctx.comm, ctx.pieces)
            gw, gb = _linear_grads(gy, full, need[1], need[2])
            gx = _unrows(finish(), ctx.shape, ctx.dim, ctx.shape[ctx.dim]) if need[0] else None
        return gx, gw, gb, None, None, None, None


class _LinearReduceScatter(Function):
    """Backward: grad x = all_gather(grad_y) @ w, overlapped; grad w = all_gather(grad_y)^T @ x."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, dim, pieces, guard):
        with guard("forward reduce-scatter (linear_reduce_scatter)"):
            out = mm_reduce_scatter(_rows(x, dim), weight.t(), comm, pieces)()
        if bias is not None:
            out.add_(bias)
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.dim, ctx.pieces, ctx.guard = comm, dim, pieces, guard
        return _unrows(out, x.shape, dim, x.shape[dim] // comm.world)

    @staticmethod
    def backward(ctx, gy):
        (x, weight), need, dim = ctx.saved_tensors, ctx.needs_input_grad, ctx.dim
        gx = gw = None
        if need[0] or need[1]:
            with ctx.guard("backward all-gather (linear_reduce_scatter)"):
                gx, gfull = all_gather_mm(_rows(gy, dim), weight, None, ctx.comm, ctx.pieces)
            gx = _unrows(gx, x.shape, dim, x.shape[dim])
            gw, _ = _linear_grads(_unrows(gfull, gy.shape, dim, x.shape[dim]), x, need[1], False)
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if need[2] else None
        return gx, gw, gb, None, None, None, None


def _prepare(what, x, weight, bias, group, dim, pieces, comm, timeout, guard, name="pieces"):
    """Checks, the last one collective: every rank must send the same shape and dtype (gloo
    aborts on a longer message than expected and silently takes a shorter one)."""
    world, dim, shapes = tp_world(group)[0], dim % max(x.dim(), 1), (tuple(x.shape), dim)
    if x.dim() < 2 or dim == x.dim() - 1:
        raise ValueError(f"{what}: x, dim {shapes} needs a sequence dim apart from the features")
    shape_ok = weight.dim() == 2 and weight.shape[1] == x.shape[-1]
    if not shape_ok or weight.dtype != x.dtype:  # a wrong shape: ValueError, dtype: TypeError
        raise (TypeError if shape_ok else ValueError)(
            f"{what}: weight {tuple(weight.shape)} {weight.dtype} is not [out, {x.shape[-1]}] "
            f"{x.dtype} like x")
    shape_ok = bias is None or tuple(bias.shape) == (weight.shape[0],)
    if not shape_ok or (bias is not None and bias.dtype != x.dtype):
        raise (TypeError if shape_ok else ValueError)(
            f"{what}: bias {tuple(bias.shape)} {bias.dtype} is not [{len(weight)}] {x.dtype}")
    if type(pieces) is not int or pieces < 1:  # named as the caller named it
        raise ValueError(f"{what}: {name} must be an int >= 1, got {pieces!r}")
    if what == "linear_reduce_scatter" and x.shape[dim] % world:
        raise ValueError(f"{what}: x, dim {shapes} not divisible by the tensor-parallel size")
    if world == 1:
        return dim, None
    timeout = as_timedelta(timeout)
    comm, p = launcher(comm, group, timeout), C10dComm(group, timeout)
    sent = weight.shape[1 if what == "all_gather_linear" else 0]  # features on the wire

    def gather(mine):  # the digest by isend/irecv: 113 us here, all_gather_single 295 us
        every = mine.repeat(world)
        p._swap([(every[p.rank:p.rank + 1], q) for q in p.peers],
                [(every[q:q + 1], q) for q in p.peers], TAG + 1)()
        return every
    with guard("shape check (" + what + ")"):
        # on x's device: NCCL sends CUDA tensors only (a host copy would be a silent round trip)
        agree([x.numel() // x.shape[-1], sent, what, str(x.dtype)], None, group, what=what,
              device=x.device, gather=gather,
              differ=lambda every: "ranks disagree on (rows, features sent, op, dtype): "
              f"{every} in rank order")
    return dim, comm


def _run(fn, what, x, weight, bias, group, dim, pieces, comm, timeout, guard, chunks):
    """Autocast resolved as F.linear resolves it, then the checks and fn (the overlapped
    Function) with autocast off; guard None: errors name `what` and break nothing. chunks: the
    deprecated name of pieces."""
    name = "pieces"
    if chunks is not None:
        warnings.warn(f"{what}(chunks=) is deprecated: pieces=", DeprecationWarning, stacklevel=3)
        pieces, name = chunks, "chunks"
    guard = guard if guard is not None else CommGuard("")
    (x, weight, bias), no_autocast = autocast_linear_args(x, weight, bias)
    with no_autocast:
        dim, c = _prepare(what, x, weight, bias, group, dim, pieces, comm, timeout, guard, name)
        return F.linear(x, weight, bias) if c is None else \
            fn.apply(x, weight, bias, c, dim, pieces, guard)


def all_gather_linear(x, weight, bias=None, group=None, dim: int = 0, pieces: int = 4,
                      comm="c10d", timeout=None, guard: CommGuard | None = None, chunks=None):
    """F.linear(all_gather(x along dim), weight, bias), the all-gather overlapped: the input of a
    sequence-parallel ColumnParallelLinear (x: this rank's sequence shard). pieces=4: the best
    median of 1-16 for both functions at 1 Gbit/s in bench/results/overlap_tp.txt. timeout
    (seconds or a timedelta): the longest wait for a peer's piece ("c10d" comm)."""
    return _run(_AllGatherLinear, "all_gather_linear", x, weight, bias, group, dim, pieces, comm,
                timeout, guard, chunks)


def linear_reduce_scatter(x, weight, bias=None, group=None, dim: int = 0, pieces: int = 4,
                          comm="c10d", timeout=None, guard: CommGuard | None = None, chunks=None):
    """reduce_scatter(F.linear(x, weight) along dim) + bias, the reduce-scatter overlapped: the
    output of a sequence-parallel RowParallelLinear (bias added once, after the sum)."""
    return _run(_LinearReduceScatter, "linear_reduce_scatter", x, weight, bias, group, dim,
                pieces, comm, timeout, guard, chunks)
