"""Ring attention (Liu et al. 2023, arXiv:2310.01889) on shards laid out by
pyfast.parallel.context: each rank keeps its queries, and key/value blocks travel around the
ring (isend to the next rank, irecv from the previous one) while the rank attends to the block
it holds. Blocks merge exactly by their log-sum-exp (pyfast.ops.attention).

Which (query, key) pairs a step computes, for rank r holding the keys of rank src:
  not causal           every query x every key
  causal, src == r     the local block under a causal mask: both layouts keep positions in
                       order inside a shard, so a top-left mask on the shard is the global one
  contiguous, src < r  every query x every key;   src > r: nothing (masked)
  zigzag (chunks r, 2N-1-r; half = one chunk)
           src < r     every query x the first half of the keys (chunk src); chunk 2N-1-src
                       lies after both of r's chunks
           src > r     the second half of the queries (chunk 2N-1-r) x every key; chunk r lies
                       before both of src's chunks
so under zigzag every off-diagonal step costs the same half block on every rank.

Backward (the ring again): the kv blocks travel as in forward; a block's dK/dV accumulator
(fp32) starts at the first rank that attends to it, collects each rank's share on its way
around and reaches its owner after the last; each rank's own share of its own block stays
local. Each share is computed from the merged out and lse saved by forward
(block_attention_backward), so no scores are kept between the passes.

Transfers: each step's sends (to the next rank) and receives (from the previous one) go in one
batch_isend_irecv, and every rank orders them alike: the accumulator passed on from the step
before, then k, then v. So the receives pair with the sends in posting order, as NCCL pairs
them (it has no tags; tests/test_nccl_lane.py runs the ring so), and two ranks sending to each
other at once cannot deadlock under NCCL.

Heads are processed in passes of `heads_per_pass`: the send/receive buffers hold one pass's
heads (memory per rank ~ the shards plus 7/passes of one shard), and each pass's final dK/dV
transfer overlaps the next pass's compute, so only the last pass's is exposed.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from pyfast._ranges import ranged
from pyfast.comm.failure import CommError, naming
from pyfast.ops.attention import block_attention, block_attention_backward, default_scale

from .cp_agree import settle, wait_polling

TAG_K, TAG_V, TAG_ACC = 7301, 7302, 7303  # k and v blocks, dK/dV accumulators: one stream each
MIN_MESSAGE = 1 << 20  # bytes: default passes send >= 1 MB (per-message cost ~0.1 ms on loopback)

ALL = slice(None)
# What the last forward and backward waited on transfers (seconds, summed over the passes):
# the exposed communication, for benchmarks (pyfast bench cp).
last_wait = {"forward": 0.0, "backward": 0.0}
_COMM_ONLY = False


@contextlib.contextmanager
def comm_only():
    """Benchmarks only: run the ring's transfers exactly as they are, with every block's
    attention replaced by uninitialised tensors of its shape: the communication's own time."""
    global _COMM_ONLY
    _COMM_ONLY = True
    try:
        yield
    finally:
        _COMM_ONLY = False


def _fwd(q, k, v, causal, scale, backend):
    if _COMM_ONLY:
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
    return block_attention(q, k, v, causal, scale, backend)


def _bwd(do, q, k, v, o, lse, causal, scale, backend):
    if _COMM_ONLY:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    return block_attention_backward(do, q, k, v, o, lse, causal, scale, backend)


def visible(r: int, src: int, n: int, s_local: int, causal: bool, layout: str):
    """(query rows, key rows, causal) that rank r computes against src's block, or None."""
    if not causal:
        return ALL, ALL, False
    if src == r:
        return ALL, ALL, True
    if layout == "contiguous":
        return (ALL, ALL, False) if src < r else None
    half = s_local // 2
    return (ALL, slice(0, half), False) if src < r else (slice(half, None), ALL, False)


def acc_rows(src: int, upto: int, n: int, s_local: int, causal: bool, layout: str):
    """The key rows of block src that carry gradient after the ranks src+1, ..., upto (ring
    order) added their shares: a slice (start, stop), or None when none of them sees the block."""
    lo, hi = s_local, 0
    t = (src + 1) % n
    while True:
        part = visible(t, src, n, s_local, causal, layout)
        if part is not None:
            start, stop, _ = part[1].indices(s_local)
            lo, hi = min(lo, start), max(hi, stop)
        if t == upto:
            break
        t = (t + 1) % n
    return slice(lo, hi) if hi > lo else None


# A failure reaches every rank of the ring in ~POLL seconds, not only the dead rank's
# neighbours: a rank that fails (its own error, or a neighbour's reset connection) writes the
# ring's failure key in the job's store before raising, and ranks blocked on a transfer poll
# that key. The transfer itself is waited on a helper thread: gloo's irecv cannot be polled
# (Work.is_completed() stays False until wait() runs, measured on torch 2.13) and a wait with a
# timeout closes the connection for good. The key stays: a ring that failed refuses later calls
# (its peers may be a step behind), as the other modules' broken state does.
POLL = 0.05
_BROKEN: dict[str, str] = {}  # ring key -> why it failed (a rank only touches the store when
                              # a transfer keeps it waiting POLL seconds, or when it fails)


class _Ring:
    def __init__(self, group):
        self.group = group
        self.n, self.r = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(self.n)
        self.key = "pyfast/ring_attention/failed/" + ",".join(map(str, ranks))
        self.store = dist.distributed_c10d._get_default_store()
        self.check()
        self.waited = 0.0
        self.pending: list = []  # sends of this step
        self.older: list = []    # sends of the step before: waited one step later

    @ranged("pyfast.cp.exchange")
    def exchange(self, sends, recvs) -> list:
        """One batch of transfers: `sends` [(tensor, tag)] to the next rank, `recvs` into
        buffers from the previous one; the receives' works, in order. Every rank sends and
        posts in the same order (its receives pair with the previous rank's sends in posting
        order, as NCCL pairs them: the tags only help gloo), and in one batch_isend_irecv, so
        that at two ranks, where each sends to the other, NCCL cannot deadlock send against
        send. A backend that coalesces (NCCL) returns one work for the batch: it stands for
        every receive, and its sends complete with it."""
        nxt, prv = (self.r + 1) % self.n, (self.r - 1) % self.n
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt, tag=tag)
               for t, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=prv, tag=tag)
                for t, tag in recvs]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):
            self.pending += works
            return works[-1:] * len(recvs)
        self.pending += works[:len(sends)]
        return works[len(sends):]

    def pass_kv(self, kv, sends=(), recvs=()):
        """Send this (k, v) block on to the next rank (after `sends`, in one batch with them);
        (buffers of the one coming from the previous rank, the works of `recvs` and of k and
        v). k and v go separately: no copy to pack them."""
        nxt = tuple(torch.empty_like(t) for t in kv)
        works = self.exchange([*sends, *zip(kv, (TAG_K, TAG_V))],
                              [*recvs, *zip(nxt, (TAG_K, TAG_V))])
        return nxt, works

    def check(self) -> None:
        """CommError if this ring failed in an earlier call on this rank."""
        if self.key in _BROKEN:
            raise CommError(_BROKEN[self.key])

    def poll(self) -> None:
        """CommError if a rank of this ring has failed (the store's key; one round trip)."""
        if self.store.check([self.key]):
            _BROKEN[self.key] = self.store.get(self.key).decode()
            self.check()

    def fail(self, e: BaseException) -> None:
        """Remember, and tell the ring's other ranks (they raise within POLL seconds)."""
        _BROKEN.setdefault(self.key, f"rank {dist.get_rank()} failed: {type(e).__name__}: "
                                     f"{str(e)[:300]}")
        try:
            if not self.store.check([self.key]):  # the first failure names the cause
                self.store.set(self.key, _BROKEN[self.key])
        except Exception:  # noqa: BLE001  (the store's host died too: raise the first error)
            pass

    def _polled(self) -> None:
        self.poll()
        settle(self.group)  # a rank whose arguments changed alone never joins (cp_agree)

    @ranged("pyfast.cp.wait")
    def wait(self, *works):
        t0 = time.perf_counter()
        for w in works:
            wait_polling(w, self._polled, POLL)
        self.waited += time.perf_counter() - t0

    def step_done(self):
        """Wait for the sends of the step before this one (they had a whole step of compute to
        finish behind); this step's stay in flight."""
        self.wait(*self.older)
        self.older, self.pending = self.pending, []

    def flush(self):
        self.wait(*self.older, *self.pending)
        self.older, self.pending = [], []


@contextlib.contextmanager
def _failing(ring: _Ring):
    try:
        yield
    except BaseException as e:
        ring.fail(e)
        raise


def passes(h: int, bytes_per_head: int, heads_per_pass: int | None) -> list[slice]:
    if heads_per_pass is None:
        heads_per_pass = min(h, max(1, -(-MIN_MESSAGE // max(1, bytes_per_head))))
    if not (isinstance(heads_per_pass, int) and heads_per_pass >= 1):
        raise ValueError(f"heads_per_pass must be an int >= 1, got {heads_per_pass!r}")
    return [slice(h0, min(h, h0 + heads_per_pass)) for h0 in range(0, h, heads_per_pass)]


def _merge(acc, lse, rows, o, l) -> None:
    """Fold block (o, l) into the running (acc, lse) on `rows`, in place."""
    a, la = acc[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(la, l)
    a.mul_(torch.exp(la - new).unsqueeze(-1)).addcmul_(o, torch.exp(l - new).unsqueeze(-1))
    la.copy_(new)


def _block(k, v, hs):
    """This pass's heads of k and v, contiguous (a view when they already are: B = 1)."""
    return tuple(t[:, hs] if t[:, hs].is_contiguous() else t[:, hs].contiguous() for t in (k, v))


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, heads_per_pass, backend):
        ring, s_local = _Ring(group), q.shape[2]
        n, r = ring.n, ring.r
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        plan = passes(q.shape[1], 2 * k[:, :1].numel() * k.element_size(), heads_per_pass)
        with naming("context_parallel_attention(ring) forward"), _failing(ring):
            for hs in plan:
                qh, kv = q[:, hs], _block(k, v, hs)
                acc = lacc = None
                for s in range(n):
                    src = (r - s) % n
                    if s < n - 1:
                        nxt, got = ring.pass_kv(kv)
                    part = visible(r, src, n, s_local, causal, layout)
                    if part is not None:
                        qr, kr, c = part
                        o, l = _fwd(qh[:, :, qr], kv[0][:, :, kr], kv[1][:, :, kr], c, scale,
                                    backend)
                        if acc is None:  # step 0, the own block: every row sees a key
                            acc = o if o.dtype == torch.float32 else o.float()
                            lacc = l
                        else:
                            _merge(acc, lacc, qr, o, l)
                    if s < n - 1:
                        ring.wait(*got)
                        ring.step_done()
                        kv = nxt
                ring.flush()
                out[:, hs] = acc
                lse[:, hs] = lacc
        last_wait["forward"] = ring.waited
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, layout, scale, plan, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout, scale, plan, backend = ctx.args
        ring, s_local = _Ring(group), q.shape[2]
        n, r = ring.n, ring.r
        f32 = q.dtype == torch.float32
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        finish = None  # the previous pass's last step: its dK/dV coming home, still in flight
        with naming("context_parallel_attention(ring) backward"), _failing(ring):
            for hs in plan:
                qh, doh, oh, lh = q[:, hs], dout[:, hs], out[:, hs], lse[:, hs]
                kv = _block(k, v, hs)
                b, h, _, d = kv[0].shape
                mine = acc_rows(r, (r - 1) % n, n, s_local, causal, layout)  # comes home last
                got_home = home = dq_acc = own = None
                acc_out = []  # the accumulator this rank passes on: sent before the next block
                for s in range(n):
                    src = (r - s) % n
                    incoming = acc_rows(src, (r - 1) % n, n, s_local, causal, layout) \
                        if s >= 2 else None
                    acc_in = got_acc = None
                    recvs = []
                    if incoming is not None:  # sent before this step's block: received first
                        acc_in = q.new_empty((2, b, h, incoming.stop - incoming.start, d),
                                             dtype=torch.float32)
                        recvs = [(acc_in, TAG_ACC)]
                    if s < n - 1:
                        nxt, got = ring.pass_kv(kv, acc_out, recvs)
                    else:
                        got = ring.exchange(acc_out, recvs)
                    got_acc, got = (got[0] if recvs else None), got[len(recvs):]
                    acc_out = []
                    part = visible(r, src, n, s_local, causal, layout)
                    grads = None
                    if part is not None:
                        qr, kr, c = part
                        grads = _bwd(doh[:, :, qr], qh[:, :, qr], kv[0][:, :, kr],
                                     kv[1][:, :, kr], oh[:, :, qr], lh[:, :, qr], c, scale,
                                     backend)
                        if dq_acc is None:  # step 0: the own block covers every query row
                            dq_acc = _into(dq, hs, grads[0])
                        else:
                            dq_acc[:, :, qr] += grads[0]
                    if s == 0:  # own block: its dK/dV share stays here
                        own = (_into(dk, hs, grads[1]), _into(dv, hs, grads[2]))
                        grads = None
                        if finish is not None:  # behind this compute, the last pass's came home
                            finish()
                            finish = None  # frees its buffers now, not after this pass
                    else:
                        acc = _pass_on(ring, src, r, n, s_local, causal, layout, part, grads,
                                       acc_in, got_acc, incoming)
                        acc_out = [(acc, TAG_ACC)] if acc is not None else []
                    if s < n - 1:
                        ring.wait(*got)
                        ring.step_done()
                        kv = nxt
                # the last step's accumulator goes to its owner (the next rank) as this
                # rank's own comes home from the previous one
                if mine is not None:
                    home = q.new_empty((2, b, h, mine.stop - mine.start, d), dtype=torch.float32)
                got_home = ring.exchange(acc_out, [(home, TAG_ACC)] if mine is not None else [])
                got_home = got_home[0] if got_home else None
                if not f32:
                    dq[:, hs] = dq_acc
                finish = _homecoming(ring, dk, dv, hs, own, got_home, home, mine)
            finish()
            ring.flush()
        last_wait["backward"] = ring.waited
        return dq, dk, dv, None, None, None, None, None, None


def _into(out, hs, t):
    """The fp32 accumulator of out's heads hs, starting from t: out's own slice when out is
    fp32 (no buffer of its own, a shard's head: 4 MB at 32K tokens), else an fp32 copy
    written back when the pass completes."""
    if out.dtype == torch.float32:
        out[:, hs] = t
        return out[:, hs]
    return t.float()


def _homecoming(ring, dk, dv, hs, own, got_home, home, mine):
    """What completes a pass: add the dK/dV shares that come home to this rank's own (fp32
    views of dk and dv, or fp32 copies for 16-bit ones, written back then). Called after the
    next pass's first block, so the transfer hides behind it."""
    def finish():
        if got_home is not None:
            ring.wait(got_home)
            own[0][:, :, mine] += home[0]
            own[1][:, :, mine] += home[1]
        if own[0].dtype != dk.dtype:
            dk[:, hs], dv[:, hs] = own
    return finish


def _pass_on(ring, src, r, n, s_local, causal, layout, part, grads, acc_in, got_acc, incoming):
    """Add this rank's dK/dV share of block src to the accumulator that came from the previous
    rank (or start one): the accumulator to send on to the next rank (the owner, after the last
    step), or None."""
    rows = acc_rows(src, r, n, s_local, causal, layout)
    if rows is None:
        return None
    if acc_in is not None and incoming == rows:
        ring.wait(got_acc)
        acc = acc_in
    else:
        acc = torch.zeros((2, *grads[1].shape[:2], rows.stop - rows.start, grads[1].shape[3]),
                          dtype=torch.float32, device=grads[1].device) if grads is not None \
            else None
        if acc is None:  # nothing of ours and nothing new: pass the incoming one on as it is
            ring.wait(got_acc)
            acc = acc_in
        elif acc_in is not None:
            ring.wait(got_acc)
            acc[:, :, :, incoming.start - rows.start:incoming.stop - rows.start] += acc_in
    if grads is not None:
        kr = part[1].indices(s_local)
        lo, hi = kr[0] - rows.start, kr[1] - rows.start
        acc[0, :, :, lo:hi] += grads[1]
        acc[1, :, :, lo:hi] += grads[2]
    return acc


def check_broken(group) -> None:
    """CommError, before anything is exchanged, if a ring over this group failed earlier."""
    with naming("context_parallel_attention"):
        _Ring(group)


def ring_attention(q, k, v, group, causal: bool, layout: str, scale, heads_per_pass=None,
                   backend=None) -> torch.Tensor:
    return RingAttention.apply(q, k, v, group, causal, layout, default_scale(q, scale),
                               heads_per_pass, backend)
