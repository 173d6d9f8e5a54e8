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


# Every p2p call made under force_tag0, in issue order: (group name, peer's global rank, "send"
# or "recv", bytes, batch) with batch the number of the batch_isend_irecv it was part of (None:
# alone). nccl_deadlock() checks it against NCCL's stream semantics.
log: list[tuple] = []
_batch = [None, 0]  # current batch, batches so far


def _record(name, args, kwargs):
    group = kwargs.get("group", args[2] if len(args) > 2 else None) or c10d._get_default_group()
    local = kwargs.get("group_dst", kwargs.get("group_src"))
    peer = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("dst", kwargs.get("src"))
    if peer is None:
        peer = c10d.get_global_rank(group, local)
    t = args[0] if args else kwargs["tensor"]
    log.append((group.group_name, peer, "send" if name in ("isend", "send") else "recv",
                t.numel() * t.element_size(), _batch[0]))


def _tag0(fn, name):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if len(args) > TAG_ARG:
            args = args[:TAG_ARG] + (0,) + args[TAG_ARG + 1:]
        if "tag" in kwargs:
            kwargs["tag"] = 0
        _record(name, args, kwargs)
        return fn(*args, **kwargs)
    call.nccl_lane = True
    return call


def _batched(fn):
    @functools.wraps(fn)
    def call(ops):
        _batch[0], _batch[1] = _batch[1], _batch[1] + 1
        try:
            return fn(ops)
        finally:
            _batch[0] = None
    return call


@contextlib.contextmanager
def force_tag0():
    """Every p2p tag is 0 inside; nested uses are no-ops."""
    if getattr(c10d.isend, "nccl_lane", False):
        yield
        return
    orig = {n: getattr(c10d, n) for n in NAMES}
    patched = {n: _tag0(f, n) for n, f in orig.items()}
    batch = c10d.batch_isend_irecv
    to_patched = {orig[n]: patched[n] for n in NAMES}
    new, init = c10d.P2POp.__new__, c10d.P2POp.__init__

    def p2p_new(cls, op, *args, **kwargs):
        return new(cls, to_patched.get(op, op), *args, **kwargs)

    def p2p_init(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        init(self, to_patched.get(op, op), tensor, peer, group, 0, group_peer)

    for n in NAMES:
        setattr(c10d, n, patched[n])
        setattr(dist, n, patched[n])
    c10d.batch_isend_irecv = dist.batch_isend_irecv = _batched(batch)
    c10d.P2POp.__new__, c10d.P2POp.__init__ = p2p_new, p2p_init
    try:
        yield
    finally:
        for n in NAMES:
            setattr(c10d, n, orig[n])
            setattr(dist, n, orig[n])
        c10d.batch_isend_irecv = dist.batch_isend_irecv = batch
        c10d.P2POp.__new__, c10d.P2POp.__init__ = new, init


def run_tag0(rank, world, fn, *args, **kwargs):
    """A rank job: fn(rank, world, *args, **kwargs) under force_tag0. fn must be importable by
    name (it travels to the ranks by pickle)."""
    with force_tag0():
        return fn(rank, world, *args, **kwargs)


def run_logged(rank, world, fn, *args, **kwargs):
    """run_tag0, returning (fn's value, this rank's p2p log) for nccl_deadlock()."""
    log.clear()
    with force_tag0():
        value = fn(rank, world, *args, **kwargs)
    return value, list(log)


def nccl_deadlock(logs: list[list[tuple]]) -> str | None:
    """Where the ranks' p2p calls (run_logged's logs, in rank order) would hang under NCCL,
    or None. NCCL runs the calls between two ranks of a group in issue order on one stream: a
    call (or a whole batch_isend_irecv) starts when the one before it finished and finishes
    when every message in it has met its match on the other side, the k-th send from a to b
    meeting the k-th receive at b from a (of the same size, else the pairing is wrong). A
    receive issued before a send on both sides, with each side's send the other's receive,
    never finishes (for messages past NCCL's eager size). Issuing never blocks the CPU there,
    so each pair of ranks is checked on its own, in the order its calls were issued."""
    pairs: dict[tuple, dict[int, list]] = {}
    for me, entries in enumerate(logs):
        for name, peer, kind, nbytes, batch in entries:
            units = pairs.setdefault((name, min(me, peer), max(me, peer)), {}).setdefault(me, [])
            if batch is None or not units or units[-1][0] != batch:
                units.append((batch, []))
            units[-1][1].append((kind, nbytes))
    for (name, a, b), sides in pairs.items():
        # number each side's messages per direction: ("send", k) at a meets ("recv", k) at b
        streams, sizes = {}, {}
        for me in (a, b):
            count = {"send": 0, "recv": 0}
            streams[me] = []
            for _, ops in sides.get(me, []):
                unit = []
                for kind, nbytes in ops:
                    src = me if kind == "send" else (b if me == a else a)
                    key = (src, count[kind])
                    count[kind] += 1
                    if sizes.setdefault(key, nbytes) != nbytes:
                        return (f"group {name}: message {key[1]} from rank {key[0]} is "
                                f"{sizes[key]} bytes at one end, {nbytes} at the other")
                    unit.append(key)
                streams[me].append(unit)
        pos, done = {a: 0, b: 0}, set()
        while True:
            active = {me: set(streams[me][pos[me]]) if pos[me] < len(streams[me]) else set()
                      for me in (a, b)}
            moved = False
            for me, other in ((a, b), (b, a)):
                # a message moves when both of its ends are active, or it has moved already
                if active[me] and all(k in done or k in active[other] for k in active[me]):
                    done |= active[me]
                    pos[me] += 1
                    moved = True
            if not moved:
                break
        left = {me: streams[me][pos[me]:] for me in (a, b) if pos[me] < len(streams[me])}
        if left:
            return (f"group {name}, ranks {a} and {b}: NCCL would hang; calls left (message = "
                    f"(sender, number)): {left}")
    return None
