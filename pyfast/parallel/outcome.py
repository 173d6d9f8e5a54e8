"""Each pipeline step's outcome, agreed by every rank: one int32 flag (1: this rank failed)
from every rank to one rank, the root, and the outcome (1: some rank failed) back, on a process
group that carries nothing else.

Why not an all-reduce of the flag at the step's end (what the Pipeline did before): the rank
that finishes last (rank 0 under gpipe and 1F1B) then waits out the collective's round trips
after its last action; on the tiny model of `pyfast bench pipeline` (8 x Linear(256), batch
32, 8 micro-batches, 2 pinned ranks, 2-core Xeon with other jobs running) 1F1B took 1.22-1.24x
torch's Schedule1F1B with it and 1.03-1.04x without any agreement. Here the root is the rank
that finishes its schedule last (a run of the schedule says which: schedules.simulate); it posts
its receives two compute actions before its end (post_early; pipeline.EARLY), not when the step
begins (session 54: posted at the start, 3 receives on the rank that starts the pipeline before
its first forward, and the flags then land mid-step on the critical rank; tiny model, 1F1B at 4
ranks, side by side, three rounds: a step after a barrier 17.9-18.9 -> 17.6-17.8 ms, 9.2-9.3 ->
8.7-8.8 at 2 ranks) nor at the exchange (session 57: gloo sends a message only once its receive
is posted, a round trip through each sender's I/O thread after the root's last action), then
sends the outcome and returns. Every other rank sends one flag and
receives one outcome: 2 messages a rank and step, 2 (p - 1) on the root, where a flag from every
rank to every other rank (issue 32's first version) made p - 1 sends and receives on each: 6 a
rank at 4 ranks, 30 at 16.

A group of its own because after a failed step the pipeline's p2p streams still hold messages
nobody matched (drained only after this agreement): a flag posted there would pair with one of
them (NCCL, and gloo under tests/nccl_lane.py, pair messages per peer in posting order). Within
this group each pair (root, q) exchanges exactly two messages a step, q sending its flag
before it receives the outcome, the root receiving (posted at the exchange) before it sends: never a
receive before a send on both sides, so NCCL's one stream per pair cannot hang on them. A root
that cannot hear from a rank (dead) still sends "failed" to every other rank before it raises:
they learn of it from the root, as they would have from the dead rank itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pyfast.comm.dry import fake_group
from pyfast.comm.failure import naming


class Flags:
    """This rank's end of the outcome exchange of a Pipeline (p > 1 ranks in `group`). roots:
    the root rank for a training step (True) and for inference (False)."""

    def __init__(self, group, rank: int, p: int, roots: dict | None = None):
        self.group, self.rank, self.p = group, rank, p
        self.roots = roots or {True: 0, False: 0}
        self.root = self.roots[True]  # begin() sets the step's
        self.fake = fake_group(group)  # read once: dist.get_backend costs ~5 us a flag read
        self.abandoned: list = []  # a failed exchange's works and buffers, kept alive
        self._early: dict = {}  # the root's flag receives posted before its last action
        self._early_lost: dict = {}

    def _post(self, peers, device) -> dict:
        # plain irecv/isend, not batch_isend_irecv: its coalescing context costs Python on the
        # step's critical path, and each pair's order below is all NCCL needs
        out = {}
        for q in peers:
            buf = torch.zeros(1, dtype=torch.int32, device=device)
            out[q] = (dist.irecv(buf, group=self.group, group_src=q), buf)
        return out

    def begin(self, device, training: bool = True) -> None:
        """A step's first call: which rank is its root (its receives wait for post_early() or
        exchange())."""
        self.root = self.roots[training]

    def post_early(self, device) -> None:
        """On the root, before its last action: post the flags' receives, so that the flags
        of the ranks done by then travel while it computes. gloo sends an unbound buffer only
        once its receive is posted (a send-ready notice, the receiver's recv-ready, then the
        data), so receives posted in exchange() cost the root a round trip through each
        sender's I/O thread after its last action."""
        if self.rank != self.root or self._early or self._early_lost:
            return
        for q in range(self.p):  # one by one: a dead peer's must not stop the others'
            if q != self.rank:
                try:
                    self._early.update(self._post([q], device))
                except Exception as e:  # noqa: BLE001  (a dead peer: the others must hear)
                    self._early_lost[q] = e

    def _read(self, b) -> bool:
        """A flag received (comm.dry.read's rule: nothing moved on meta or a fake group)."""
        return False if self.fake or b.is_meta else bool(b.item())

    def exchange(self, failed: bool, device) -> bool:
        """Send this rank's flag, learn the outcome: True when any rank failed this step."""
        mine = torch.tensor([int(failed)], dtype=torch.int32, device=device)
        works, recvs, sent = [], {}, [mine]
        try:
            with naming("Pipeline: agreeing on the step's outcome"):
                if self.rank != self.root:  # the flag, then the outcome
                    works.append(dist.isend(mine, group=self.group, group_dst=self.root))
                    recvs = self._post([self.root], device)
                    works[0].wait()
                    recvs[self.root][0].wait()
                    return self._read(recvs[self.root][1])
                lost, anyone = dict(self._early_lost), failed
                recvs = dict(self._early)
                self._early, self._early_lost = {}, {}
                for q in range(self.p):  # one by one: a dead peer's must not stop the others'
                    if q != self.rank and q not in recvs and q not in lost:
                        try:
                            recvs.update(self._post([q], device))
                        except Exception as e:  # noqa: BLE001  (a dead peer: the others must hear)
                            lost[q] = e
                for q, (w, b) in recvs.items():
                    try:
                        w.wait()
                        anyone = self._read(b) or anyone
                    except Exception as e:  # noqa: BLE001  (a dead peer: the others must hear)
                        lost[q] = e
                sent.append(torch.tensor([int(anyone or bool(lost))], dtype=torch.int32,
                                         device=device))
                works += [dist.isend(sent[-1], group=self.group, group_dst=q) for q in recvs
                          if q not in lost]  # (a rank whose receive could not be posted: lost)
                for w in works:
                    w.wait()
                if lost:  # raised after telling every other rank the step failed
                    raise next(iter(lost.values()))
                return anyone
        except Exception:
            self.abandoned += [sent, works, recvs]
            raise
