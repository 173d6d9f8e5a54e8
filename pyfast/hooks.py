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
"""
import torch
import torch.distributed as dist

import pyfast.compress as C
from pyfast.comm import all_reduce
from pyfast.comm.collectives import all_reduce_pieces, wait_all
from pyfast.comm.failure import Breaker, naming, new_group_like
from pyfast.comm.guard import FiniteGuard


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
        self._seen: set[str] = set()
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


def _prune(state: CompressionState) -> None:
    fb = state.compressor.feedback
    if fb is not None:
        for key in [k for k in fb.memory if k.split(".")[0] not in state._seen]:
            del fb.memory[key]
    state._seen = set()


class _Pending:
    """One bucket of the iteration: its buffer, its reductions, the staging copy to undo."""

    def __init__(self, buf, fut, handles, staged=None):
        self.buf, self.fut, self.handles, self.staged = buf, fut, handles, staged


def _staged(state, name, buf, sizes, block):
    """(flat, offsets): DDP's bucket (the gradients back to back) copied so that each one
    starts at a multiple of `block`."""
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off = -(-(off + n) // block) * block
    flat = state._staging.get(name)
    if flat is None or flat.numel() != off or flat.device != buf.device:
        flat = state._staging[name] = torch.zeros(off, device=buf.device)
    else:
        flat.zero_()  # the gaps hold the previous reduction's decoded values
    with torch.no_grad():
        for a, o, n in zip(_starts(sizes), offsets, sizes):
            flat[o:o + n].copy_(buf[a:a + n])
    return flat, offsets


def _starts(sizes):
    out, a = [], 0
    for n in sizes:
        out.append(a)
        a += n
    return out


def _reduce(state, c, name, bucket, buf):
    group = state._group
    # the parameters, not bucket.gradients(): a parameter unused on this rank (DDP's
    # find_unused_parameters) has no gradient tensor there, but its zeros are in the buffer
    params = bucket.parameters()
    sizes = [p.numel() for p in params]
    if sum(sizes) != buf.numel():  # same on every rank: the layout is DDP's, not the data's
        raise RuntimeError(f"DDP bucket {name}: {buf.numel()} elements but its parameters "
                           f"have {sum(sizes)} (a DDP layout this hook does not know)")
    if c.per_tensor:  # whole tensors: a matrix, a selection
        pieces = [(i, a, p.shape) for i, (a, p) in enumerate(zip(_starts(sizes), params))]
        return [all_reduce_pieces(buf, pieces, c, group, op="avg", name=name)], None
    block = c.block
    if block > 1 and len(sizes) > 1:
        flat, offsets = _staged(state, name, buf, sizes, block)
        return [all_reduce(flat, c, group, op="avg", async_op=True, name=name)], (flat, offsets, sizes)
    return [all_reduce(buf, c, group, op="avg", async_op=True, name=name)], None


def _complete(state: CompressionState, side, pending: list) -> None:
    """On the communication thread, once the side band (FIFO: after every bucket) is done."""
    try:
        with state.breaker.guard("compression_hook reduction"):
            wait_all([h for p in pending for h in p.handles] + [side])
        for p in pending:
            if p.staged is not None:  # DDP's buffer holds the gradients back to back
                flat, offsets, sizes = p.staged
                with torch.no_grad():
                    for a, o, n in zip(_starts(sizes), offsets, sizes):
                        p.buf[a:a + n].copy_(flat[o:o + n])
        flags = [int(f) for f in side.wait().tolist()]
        state.skipped = state.guard.settle(flags, [f"bucket{i}" for i in range(len(pending))],
                                           lambda i: pending[i].buf.fill_(float("nan")))
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
    # DDP rebuilds its buckets once, after the first iteration, so an index can change size:
    # the size is part of the key, and keys of buckets that no longer exist are dropped.
    name = f"bucket{bucket.index()}:{buf.numel()}"
    c = state.compressor if state.iter >= state.start_iter else C.get(None)
    if not state._pending:
        state.guard.begin()
    ok = state.guard.local_ok(buf)
    if not ok:  # send zeros, keep the memory out of it; the side band tells every rank
        buf.zero_()
    c = state.guard.for_bucket(c, name, ok)
    state._seen.add(name)
    fut = torch.futures.Future()
    with naming(f"compression_hook on {name}"):
        handles, staged = _reduce(state, c, name, bucket, buf)
    state._pending.append(_Pending(buf, fut, handles, staged))
    state._pending[-1].bad = not ok
    if bucket.is_last():
        state.iter += 1
        _prune(state)
        pending, state._pending = state._pending, []
        flags = torch.tensor([float(p.bad) for p in pending], device=buf.device)
        side = all_reduce(flags, None, state._group, op="sum", async_op=True,
                          name="sideband")
        side.future.add_done_callback(lambda _: _complete(state, side, pending))
    return fut
