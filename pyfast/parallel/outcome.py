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

    def _post(self, peers, device) -> dict:
        # plain irecv/isend, not batch_isend_irecv: its coalescing context costs Python on the
        # step's critical path, and each pair's order below is all NCCL needs
        out = {}
        for q in peers:
            buf = torch.zeros(1, dtype=torch.int32, device=device)
            out[q] = (dist.irecv(buf, group=self.group, group_src=q), buf)
        return out

    def begin(self, device) -> None:
        """Post the receives from the higher ranks (a step's first call)."""
        peers = [q for q in self.higher if q not in self.recvs]
        if peers:
            with naming("Pipeline: posting the step's outcome receives"):
                self.recvs.update(self._post(peers, device))

    def exchange(self, failed: bool, device) -> bool:
        """Send this rank's flag, read everyone's: True when any rank failed this step."""
        mine = torch.tensor([int(failed)], dtype=torch.int32, device=device)
        works, recvs, self.recvs = [], self.recvs, {}
        try:
            with naming("Pipeline: agreeing on the step's outcome"):
                for q in self.higher:  # posted at the step's start unless that start failed
                    if q not in recvs:
                        recvs.update(self._post([q], device))
                for q in self.lower + self.higher:  # to a lower rank: before receiving from it
                    works.append(dist.isend(mine, group=self.group, group_dst=q))
                recvs.update(self._post(self.lower, device))
                for w in works:
                    w.wait()
                for w, _ in recvs.values():
                    w.wait()
        except Exception:
            self.abandoned += [mine, works, recvs]
            raise
        flags = [b for _, b in recvs.values()]
        return failed or any(read(b, [0], self.group)[0] for b in flags)
