"""Compression for users who keep torch's DistributedDataParallel:

    ddp.register_comm_hook(CompressionState("int8"), compression_hook)

Works on gloo and NCCL alike (torch's own quantization hooks are CUDA-only): the reduction is
pyfast.comm.all_reduce, run on pyfast's communication thread; DDP waits on the futures.

As DataParallel does (pyfast.parallel.data), a parameter's compression error never depends on
its neighbours in DDP's bucket: for the block quantizers (int8, int4, fp8, sign) the gradients
are copied into a staging buffer where each parameter starts on a block boundary (two copies of
the bucket, in and out), top-k and PowerSGD reduce each parameter alone. NaN/Inf gradients are
handled per iteration with GradScaler's semantics (check_finite, pyfast.comm.guard): every
bucket's future completes once the iteration's last bucket and a small side band (one flag per
bucket) are reduced, which DDP waits for anyway before it copies the buckets into .grad.

Compressor state (error feedback, PowerSGD's Q) is keyed by parameter, never by bucket
position: DDP rebuilds its buckets after the first iteration (same index and size, another
parameter order), which crashed step 2 of a top-k run and would have added one parameter's
remembered error to another's gradient under int8. A parameter is numbered p0, p1, ... in the
order the hook first sees it (DDP's first buckets, the same on every rank: reverse registration
order). Per-tensor compressors keep state under "bucket.p<k>"; the others stage the bucket's
parameters in the order of their numbers, under "bucket[<numbers>]", so a reordered bucket finds
its memory where it left it. A bucket whose parameter set DDP changed starts a new memory (the
old one is dropped after two iterations unseen; a checkpoint's memory, saved for the rebuilt
buckets, waits through the first, pre-rebuild iteration of a resumed run).
"""
import weakref

import torch
import torch.distributed as dist

import pyfast.compress as C
from pyfast.comm import all_reduce
from pyfast.comm.collectives import all_reduce_pieces
from pyfast.comm.failure import Breaker, naming, new_group_like
from pyfast.comm.guard import FiniteGuard, owns
from pyfast.comm.ready import wait_then_raise


class CompressionState:
    """State of compression_hook: the compressor, its error-feedback memory (per bucket) and
    the iteration count. For the first `start_iter` iterations gradients are reduced
    uncompressed (as torch's PowerSGD state does), letting training settle first.

    check_finite: "skip" (default: a GradScaler works as with DDP's own reduction), "raise" or
    False, as DataParallel's. After a failed collective (a dead peer) the state is broken and
    the next iteration's hook raises rather than pair mismatched collectives.

    The reductions run on a private copy of `process_group` (same ranks; `timeout` if given,
    else the group's own), made here: construction is collective, like dist.new_group. DDP
    issues collectives of its own during backward on its group (with
    find_unused_parameters=True, the used-parameter map), from its thread; on one shared group
    they would pair with this hook's in a different order on each rank (seen as a hang)."""

    def __init__(self, spec="int8", process_group=None, start_iter: int = 0,
                 error_feedback: bool = True, check_finite="skip", timeout=None):
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        if not dist.is_initialized():
            raise RuntimeError("CompressionState needs torch.distributed initialized (it makes "
                               "its own process group, like dist.new_group)")
        base = C.get(spec)
        self.compressor = C.wrap(base, error_feedback)
        self.process_group, self.start_iter, self.iter = process_group, start_iter, 0
        self._group = new_group_like(process_group, timeout)
        self.guard = FiniteGuard(check_finite, lambda: [self.compressor])
        self.breaker = Breaker("this CompressionState")
        self.skipped = False  # whether the last iteration was skipped (non-finite gradients)
        self._seen: set[str] = set()  # the state names this iteration used
        self._unseen: dict[str, int] = {}  # feedback memory name -> iterations not used
        self._numbers: dict[int, tuple] = {}  # id(parameter) -> (weakref, its number)
        self._count = 0  # numbers given so far
        self._pending: list = []  # this iteration's buckets, completed with the last one
        self._staging: dict = {}

    def state_dict(self) -> dict:
        return {"spec": self.compressor.spec, "iter": self.iter,
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict, device=None) -> None:
        """device: the model's, where the error-feedback memory goes (saved on the CPU); None:
        each memory moves to its bucket's device when the hook first sees the bucket."""
        if state["spec"] != self.compressor.spec:
            raise ValueError(f"state is for {state['spec']!r}, not {self.compressor.spec!r}")
        self.iter = int(state["iter"])
        if self.compressor.feedback is not None:
            self.compressor.load_state_dict(state["compressor"], device)
        else:
            self.compressor.load_state_dict(state["compressor"])


def _prune(state: CompressionState, seen: set) -> None:
    """Drop the feedback memory of parameter sets unused for two iterations (see the module);
    after a completed iteration only: a skipped one leaves the memory exactly as it was."""
    fb = state.compressor.feedback
    if fb is not None:
        for key in list(fb.memory):
            used = any(owns(n, key) for n in seen)
            state._unseen[key] = 0 if used else state._unseen.get(key, 0) + 1
            if state._unseen[key] >= 2:
                del fb.memory[key], state._unseen[key]
    for key in [k for k in state._staging if k not in seen]:  # a regrouped bucket's copy
        del state._staging[key]


def _numbers(state, params) -> list[int]:
    """Each parameter's number (the order the hook first saw it: the same on every rank)."""
    out = []
    for p in params:
        got = state._numbers.get(id(p))
        if got is None or got[0]() is not p:  # an id reused by a new tensor: a new number
            got = state._numbers[id(p)] = (weakref.ref(p), state._count)
            state._count += 1
        out.append(got[1])
    return out


def _span(numbers) -> str:
    """[3, 4, 5, 9] -> "p3-5,p9": a parameter set's name, short for the usual runs."""
    runs, out = [], []
    for k in sorted(numbers):
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    for a, b in runs:
        out.append(f"p{a}" if a == b else f"p{a}-{b}")
    return ",".join(out)


class _Pending:
    """One bucket of the iteration: its buffer, its reductions, the staging copy to undo."""

    def __init__(self, buf, fut, handles, staged=None):
        self.buf, self.fut, self.handles, self.staged = buf, fut, handles, staged


def _staged(state, name, buf, sizes, numbers, block):
    """(flat, moves): DDP's bucket (the gradients back to back) copied in the order of the
    parameters' numbers, each starting at a multiple of `block`; moves: (start in DDP's
    buffer, offset in flat, numel) per parameter, to copy the result back."""
    starts, moves, off = _starts(sizes), [], 0
    for i in sorted(range(len(sizes)), key=numbers.__getitem__):
        moves.append((starts[i], off, sizes[i]))
        off = -(-(off + sizes[i]) // block) * block
    flat = state._staging.get(name)
    if flat is None or flat.numel() != off or flat.device != buf.device:
        flat = state._staging[name] = torch.zeros(off, device=buf.device)
    else:
        flat.zero_()  # the gaps hold the previous reduction's decoded values
    with torch.no_grad():
        for a, o, n in moves:
            flat[o:o + n].copy_(buf[a:a + n])
    return flat, moves


def _starts(sizes):
    out, a = [], 0
    for n in sizes:
        out.append(a)
        a += n
    return out


def _names(c, numbers) -> list[str]:
    """The state names a bucket's reduction uses: one per parameter for per-tensor compressors
    (all_reduce_pieces' "bucket.p<k>"), else one for the parameter set."""
    if c.per_tensor:
        return [f"bucket.p{k}" for k in numbers]
    return [f"bucket[{_span(numbers)}]"]


def _reduce(state, c, name, params, numbers, buf):
    group = state._group
    sizes = [p.numel() for p in params]
    if sum(sizes) != buf.numel():  # same on every rank: the layout is DDP's, not the data's
        raise RuntimeError(f"DDP bucket {name}: {buf.numel()} elements but its parameters "
                           f"have {sum(sizes)} (a DDP layout this hook does not know)")
    if c.per_tensor:  # whole tensors: a matrix, a selection
        pieces = [(f"p{k}", a, p.shape) for k, a, p in zip(numbers, _starts(sizes), params)]
        return [all_reduce_pieces(buf, pieces, c, group, op="avg", name="bucket")], None
    (key,) = _names(c, numbers)
    # staged: aligned blocks, and (lossy: with a memory) the parameters in the order of their
    # numbers, so that the memory lines up with them whatever order DDP put them in. Decided by
    # c.block and c.lossy, which a non-finite rank's c.base shares: the same layout everywhere.
    if len(sizes) > 1 and (c.block > 1 or c.lossy):
        flat, moves = _staged(state, key, buf, sizes, numbers, c.block)
        return [all_reduce(flat, c, group, op="avg", async_op=True, name=key)], (flat, moves)
    return [all_reduce(buf, c, group, op="avg", async_op=True, name=key)], None


def _complete(state: CompressionState, side, pending: list, seen: set) -> None:
    """On the communication thread, once the side band (FIFO: after every bucket) is done."""
    try:
        with state.breaker.guard("compression_hook reduction"):
            wait_then_raise([h for p in pending for h in p.handles] + [side])
        for p in pending:
            if p.staged is not None:  # DDP's buffer holds the gradients back to back
                flat, moves = p.staged
                with torch.no_grad():
                    for a, o, n in moves:
                        p.buf[a:a + n].copy_(flat[o:o + n])
        flags = [int(f) for f in side.wait().tolist()]
        state.skipped = state.guard.settle(flags, [f"bucket{i}" for i in range(len(pending))],
                                           lambda i: pending[i].buf.fill_(float("nan")))
        if not state.skipped:
            _prune(state, seen)
    except BaseException as e:
        for p in pending:
            p.fut.set_exception(e)
        return
    for p in pending:
        p.fut.set_result(p.buf)


# no `from __future__ import annotations`: DDP checks these annotations as objects
def compression_hook(state: CompressionState,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.breaker.check()
    buf = bucket.buffer()
    name = f"bucket{bucket.index()}"  # for messages only: state is keyed by parameter
    # the parameters, not bucket.gradients(): a parameter unused on this rank (DDP's
    # find_unused_parameters) has no gradient tensor there, but its zeros are in the buffer
    params = bucket.parameters()
    numbers = _numbers(state, params)
    c = state.compressor if state.iter >= state.start_iter else C.get(None)
    if not state._pending:
        state.guard.begin()
    ok = state.guard.local_ok(buf)
    if not ok:  # send zeros, keep the memory out of it; the side band tells every rank
        buf.zero_()
    keys = _names(c, numbers)
    # c.base if this rank is not finite ("skip" stages the memories' updates: comm.guard)
    c = [state.guard.for_bucket(c, key, ok) for key in keys][-1]
    state._seen.update(keys)
    fut = torch.futures.Future()
    with naming(f"compression_hook on {name}"):
        handles, staged = _reduce(state, c, name, params, numbers, buf)
    state._pending.append(_Pending(buf, fut, handles, staged))
    state._pending[-1].bad = not ok
    if bucket.is_last():
        state.iter += 1
        pending, state._pending = state._pending, []
        seen, state._seen = state._seen, set()
        flags = torch.tensor([float(p.bad) for p in pending], device=buf.device)
        side = all_reduce(flags, None, state._group, op="sum", async_op=True,
                          name="sideband")
        side.future.add_done_callback(lambda _: _complete(state, side, pending, seen))
    return fut
