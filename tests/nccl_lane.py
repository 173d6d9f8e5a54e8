"""The NCCL-semantics lane: inside a rank process, every point-to-point message of
torch.distributed gets tag 0, whatever its caller asked for. gloo then pairs the sends and
receives between two ranks in the order they were posted, which is what NCCL does (it has no
tags at all). Code that relies on tags to pair its messages fails here as it would on GPUs: a
size mismatch aborts ("Received data size doesn't match"), a same-size mismatch gives wrong
numbers, which the lane's tests compare against dense references.

    with force_tag0():      # in a rank job; restores torch's functions on exit
        ...

Patched: torch.distributed.{isend, irecv, send, recv} (and distributed_c10d's, which
send_object_list and batch_isend_irecv call) and P2POp, whose op is mapped to the patched
function and whose tag is 0 (batch_isend_irecv passes op.tag on). Test-only: production code
never imports this.
"""
from __future__ import annotations

import contextlib
import functools

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

NAMES = ("isend", "irecv", "send", "recv")
TAG_ARG = 3  # (tensor, dst|src, group, tag, ...) in all four signatures


def _tag0(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if len(args) > TAG_ARG:
            args = args[:TAG_ARG] + (0,) + args[TAG_ARG + 1:]
        if "tag" in kwargs:
            kwargs["tag"] = 0
        return fn(*args, **kwargs)
    call.nccl_lane = True
    return call


@contextlib.contextmanager
def force_tag0():
    """Every p2p tag is 0 inside; nested uses are no-ops."""
    if getattr(c10d.isend, "nccl_lane", False):
        yield
        return
    orig = {n: getattr(c10d, n) for n in NAMES}
    patched = {n: _tag0(f) for n, f in orig.items()}
    to_patched = {orig[n]: patched[n] for n in NAMES}
    new, init = c10d.P2POp.__new__, c10d.P2POp.__init__

    def p2p_new(cls, op, *args, **kwargs):
        return new(cls, to_patched.get(op, op), *args, **kwargs)

    def p2p_init(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        init(self, to_patched.get(op, op), tensor, peer, group, 0, group_peer)

    for n in NAMES:
        setattr(c10d, n, patched[n])
        setattr(dist, n, patched[n])
    c10d.P2POp.__new__, c10d.P2POp.__init__ = p2p_new, p2p_init
    try:
        yield
    finally:
        for n in NAMES:
            setattr(c10d, n, orig[n])
            setattr(dist, n, orig[n])
        c10d.P2POp.__new__, c10d.P2POp.__init__ = new, init


def run_tag0(rank, world, fn, *args, **kwargs):
    """A rank job: fn(rank, world, *args, **kwargs) under force_tag0. fn must be importable by
    name (it travels to the ranks by pickle)."""
    with force_tag0():
        return fn(rank, world, *args, **kwargs)
