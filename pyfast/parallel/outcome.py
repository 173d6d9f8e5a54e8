"""Each pipeline step's outcome, agreed by every rank: one int32 flag (1: this rank failed)
sent to every other rank, on a process group that carries nothing else.

Why not an all-reduce of the flag at the step's end (what the Pipeline did before): the rank
that finishes last (rank 0 under gpipe and 1F1B) then waits out the collective's round trips
after its last action; on the tiny model of `pyfast bench pipeline` (8 x Linear(256), batch
32, 8 micro-batches, 2 pinned ranks, 2-core Xeon with other jobs running) 1F1B took 1.22-1.24x
torch's Schedule1F1B with it and 1.03-1.04x without any agreement. Here the lower rank of every
pair posts its receive when the step begins, so the flags of ranks that finished earlier are
already there when it ends: it sends its own and returns.

A group of its own because after a failed step the pipeline's p2p streams still hold messages
nobody matched (drained only after this agreement): a flag posted there would pair with one of
them (NCCL, and gloo under tests/nccl_lane.py, pair messages per peer in posting order). Within
this group each pair exchanges exactly two messages a step, the higher rank sending before it
receives, the lower rank receiving (posted early) before it sends: never a receive before a send
on both sides, so NCCL's one stream per pair cannot hang on them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pyfast.comm.dry import read
from pyfast.comm.failure import naming


class Flags:
    """This rank's end of the outcome exchange of a Pipeline (p > 1 ranks in `group`)."""

    def __init__(self, group, rank: int, p: int):
        self.group, self.rank, self.p = group, rank, p
        self.higher = list(range(rank + 1, p))  # they send first: receive from them early
        self.lower = list(range(rank))
        self.recvs: dict = {}    # peer -> (work, buffer) posted and not yet read
        self.abandoned: list = []  # a failed exchange's works and buffers, kept alive

    def _recv_ops(self, peers, device):
        bufs = {q: torch.zeros(1, dtype=torch.int32, device=device) for q in peers}
        return bufs, [dist.P2POp(dist.irecv, bufs[q], group=self.group, group_peer=q)
                      for q in peers]

    def begin(self, device) -> None:
        """Post the receives from the higher ranks (a step's first call)."""
        peers = [q for q in self.higher if q not in self.recvs]
        if not peers:
            return
        bufs, ops = self._recv_ops(peers, device)
        with naming("Pipeline: posting the step's outcome receives"):
            works = dist.batch_isend_irecv(ops)
        self.recvs.update({q: (w, bufs[q]) for q, w in zip(peers, works)})

    def exchange(self, failed: bool, device) -> bool:
        """Send this rank's flag, read everyone's: True when any rank failed this step."""
        self.begin(device)  # posted at the step's start unless that start failed
        mine = torch.tensor([int(failed)], dtype=torch.int32, device=device)
        low_bufs, low_recvs = self._recv_ops(self.lower, device)
        ops = [dist.P2POp(dist.isend, mine, group=self.group, group_peer=q)
               for q in range(self.p) if q != self.rank] + low_recvs
        recvs, self.recvs = self.recvs, {}
        try:
            with naming("Pipeline: agreeing on the step's outcome"):
                works = dist.batch_isend_irecv(ops)
                for w in works:
                    w.wait()
                for w, _ in recvs.values():
                    w.wait()
        except Exception:
            self.abandoned += [mine, low_bufs, recvs, locals().get("works")]
            raise
        flags = [b for _, b in recvs.values()] + list(low_bufs.values())
        return failed or any(read(b, [0], self.group)[0] for b in flags)
