"""Hybrid sharding (FSDP's HYBRID_SHARD / HSDP, MiCS): zero(..., group=SHARD,
replica_group=REPLICA, replica_compressor=SPEC) shards parameters, gradients and optimizer
state over SHARD (the ranks of a node) and replicates them across REPLICA (the ranks holding
the same shard in the other nodes).

Per unit and step, after the reduce-scatter over SHARD (exact unless zero's `compressor` is
given) hands this rank its gradient shard averaged over the node, the shard is all-reduced
(averaged) over REPLICA through `replica_compressor` with error feedback per unit shard (its
memory under u.name + ".r", saved and loaded with the model's compressor state). So the slow
link carries 1/N of the gradient (N = the shard group's size), compressed; stage 3's
all-gathers and stage 1/2's parameter all-gather stay inside SHARD.

Launch order: the replica all-reduce of unit u is queued on comm's FIFO worker right behind
u's reduce-scatter (it waits for it there: on the same worker, or on the native engine's
thread), so it overlaps the rest of backward under stages 2/3, and every rank issues the
SHARD and REPLICA collectives in one order: unit 0's reduce-scatter, unit 0's all-reduce,
unit 1's ... (no two ranks wait on each other crosswise).

Replicas stay bit-identical: a compressed all_reduce leaves every rank of REPLICA with the
same bytes decoded in the same rank order (pyfast.comm.collectives), so the gradient shards,
hence the optimizer's steps on identical masters, are identical; the initial broadcast, the
buffers' broadcast at every forward, the layout agreement and the side band of unused
parameters run over both groups (tests/test_zero_hybrid.py checks the bits).

Bytes: `bytes_sent` counts what this rank sends over REPLICA (comm.cost.sent_bytes of each
all-reduce: the payloads the algorithm moves, TCP headers aside), so a job can report the
cross-node bytes apart from its total (tests check the count against /proc/self/io).
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from pyfast import _dist
from pyfast.comm import all_reduce
from pyfast.comm.buckets import broadcast_coalesced
from pyfast.comm.collectives import Handle, NonFiniteGradient
from pyfast.comm.cost import sent_bytes


class Replicas:
    """The cross-replica half of a hybrid-sharded zero() model (module docstring)."""

    def __init__(self, group, compressor):
        self.group, self.compressor = group, compressor
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0  # cumulative, this rank, over `group`
        self._mesh_ranks = None
        self._sent: dict[int, int] = {}

    def describe(self) -> list[str]:
        return [f"replica_compressor {self.compressor.spec}", f"replicas {self.world}"]

    def _reduce(self, u, out, before) -> None:
        if before is not None:
            before.wait()
        all_reduce(out, self.compressor, self.group, op="avg", name=f"{u.name}.r")

    def launch(self, u, out: torch.Tensor, before, async_op: bool):
        """All-reduce (average) unit u's reduced shard `out` over the replicas once `before`
        (the reduce-scatter's handle, None when it is done) completes: a Handle on comm's FIFO
        worker, or None after doing it now (async_op=False)."""
        n = out.numel()
        if n not in self._sent:  # a fixed layout: a few unit sizes, computed once each
            self._sent[n] = sent_bytes(self.compressor, n, self.world)
        self.bytes_sent += self._sent[n]
        if not async_op:
            self._reduce(u, out, before)
            return None
        return Handle.on_worker(self._reduce, u, out, before)

    def sum_flags(self, t: torch.Tensor) -> None:
        """The side band's flags (already summed over the shard group) summed over the replicas:
        a parameter used on any rank of the job counts as used everywhere."""
        all_reduce(t, None, self.group, op="sum")

    def broadcast(self, tensors) -> None:
        """Replica 0's values into every replica (before the shard group's broadcast)."""
        if tensors:
            broadcast_coalesced(list(tensors), self.group)

    def mesh_ranks(self, table: torch.Tensor, device) -> torch.Tensor:
        """(replicas, *table.shape) global ranks: entry i this rank's `table` (its shard
        group's ranks, or its (tp, shard) ranks) as replica i holds it (one all-gather over the
        replicas; cached)."""
        if self._mesh_ranks is None:
            mine = table.to(device)
            every = mine.new_empty(self.world, *mine.shape)
            _dist.all_gather_single(every.view(-1), mine.reshape(-1), group=self.group)
            self._mesh_ranks = every.cpu()
        return self._mesh_ranks


def check_replicas(group, replica_group, replica_compressor) -> None:
    """zero()'s arguments for hybrid sharding, before any collective."""
    if replica_group is None:
        if replica_compressor is not None:
            raise ValueError(f"replica_compressor={replica_compressor!r} compresses hybrid "
                             "sharding's all-reduce across replica_group; give replica_group "
                             "too (or leave it out)")
        return
    me = dist.get_rank()
    shard = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    reps = dist.get_process_group_ranks(replica_group)
    if me not in reps:
        raise ValueError(f"replica_group {reps} does not hold this rank ({me})")
    if set(shard) & set(reps) != {me}:
        raise ValueError(f"replica_group {reps} and group {shard} share ranks other than this "
                         f"one ({me}): a replica group holds one rank of each shard group")


class Quorum(Replicas):
    """Hybrid sharding's replica half under torchft (zero(..., replicas=R): a
    pyfast.parallel.ft.Replicas): `group` (the shard group) is this replica group's dp ranks,
    and each unit's reduced shard is averaged over the participating replica groups on R.group
    (the quorum's group, reconfigured when a group dies or joins: rank r of every group holds
    the same shard), through replica_compressor: summed, then divided by R.participants read at
    that step (never a cached world). The error-feedback memory of the step is staged
    (ErrorFeedback.begin_step at the step's first unit) and kept or dropped by R.commit();
    a failed collective on R.group is reported to torchft (R.report), not raised: the model
    stays usable and this group's step does not commit. The compressor's own state travels
    to a healing group; its memory does not (pyfast.parallel.ft_reduce says why)."""

    torchft = True

    def __init__(self, ft, compressor):
        self.ft, self.compressor = ft, compressor
        self.bytes_sent = 0
        self._sent: dict[tuple[int, int], int] = {}
        self._open = False
        fb = compressor.feedback
        if fb is not None:
            ft.on_commit(lambda: self._settle(fb.commit), lambda: self._settle(fb.rollback))
        inner = getattr(compressor, "inner", compressor)
        ft.register("zero.replica_compression", lambda: copy.deepcopy(inner.state_dict()),
                    inner.load_state_dict)

    def _settle(self, how) -> None:
        how()
        self._open = False

    @property
    def group(self):
        return self.ft.group

    @property
    def world(self) -> int:
        return self.ft.participants

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def describe(self) -> list[str]:  # agreed inside the replica group only
        return [f"replica_compressor {self.compressor.spec}", "replicas torchft"]

    def _reduce(self, u, out, before) -> None:
        if before is not None:
            before.wait()
        if not self.ft.participating:  # a spare: contributes nothing
            out.zero_()
        all_reduce(out, self.compressor, self.group, op="sum", name=f"{u.name}.r")
        out.div_(self.ft.participants)

    def launch(self, u, out: torch.Tensor, before, async_op: bool):
        fb = self.compressor.feedback
        if fb is not None and not self._open:  # the step's first unit: stage its updates
            fb.begin_step()
            self._open = True
        key = (out.numel(), self.world)
        if key not in self._sent:
            self._sent[key] = sent_bytes(self.compressor, *key)
        self.bytes_sent += self._sent[key]
        if not async_op:
            self._reduce(u, out, before)
            return None
        return Handle.on_worker(self._reduce, u, out, before)

    def broadcast(self, tensors) -> None:
        """Buffers: the quorum's rank 0's into every group; a failure is reported."""
        with self.reported():
            super().broadcast(tensors)

    def mesh_ranks(self, table, device):
        from pyfast.parallel.ft import FTError
        raise FTError("a DCP checkpoint of zero(..., replicas=R) across replica groups: not "
                      "supported (the quorum's ranks are not this job's); save per replica "
                      "group, e.g. from group 0")

    @contextlib.contextmanager
    def reported(self):
        """A failed reduction is torchft's to handle (ft_reduce.ReplicaReduce.reported)."""
        try:
            yield
        except NonFiniteGradient:  # the caller's to see, as without torchft
            raise
        except Exception as e:  # noqa: BLE001 - whatever the backend raised for a dead peer
            self.ft.report(e)


def check_torchft(stage: int, replica_group, offload) -> None:
    """zero(replicas=R)'s arguments, before any collective: FTError for what cannot run."""
    from pyfast.parallel.ft import FTError
    if replica_group is not None:
        raise FTError("zero(replicas=R): the replica dimension is torchft's quorum; leave "
                      "replica_group out (group is this replica group's shard group)")
    if stage != 2:
        raise FTError(f"zero(replicas=R) runs stage 2 (stage {stage} asked): stage 1 reduces "
                      "inside opt.step(), after torchft's commit vote, and stage 3 under torchft "
                      "is not built")
    if offload is not None:
        raise FTError(f"zero(replicas=R, offload={offload!r}): not built under torchft")
