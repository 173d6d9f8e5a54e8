"""Mesh: the dp x cp x tp x pp layout of a job's ranks, one validated object passed explicitly.

Built on torch's DeviceMesh (init_device_mesh) with Megatron's rank order: tp innermost (the
ranks of a tensor-parallel group are neighbours, on one node when nodes hold tp ranks), then
cp (context parallelism: ranks sharing one sequence), then dp, then pp outermost. Global rank
r sits at

    pp = r // (dp * cp * tp),  dp = (r // (cp * tp)) % dp,  cp = (r // tp) % cp,  tp = r % tp

    mesh = Mesh(dp=2, tp=2, pp=1)          # collective over the default group
    DataParallel(model, group=mesh.dp_group); parallelize(model, plan, group=mesh.tp_group)

The ranks of a cp group hold the same parameters and see different tokens of the same
sequences, so gradients are averaged over dp x cp: dp_cp_group (the dp_group itself when
cp == 1).

Replicas (DiLoCo, pyfast.parallel.diloco): Mesh(..., replicas=R) lays R copies of that inner
mesh side by side, the replica outermost, so each replica's inner mesh is the contiguous ranks
[k * inner, (k + 1) * inner) and its dp/cp/tp/pp groups are the layout above shifted by k * inner.
replica_group is the R ranks with this rank's inner coordinates (the same shard in every
replica): replica = r // inner. replicas=1 (the default) is exactly the mesh above.

Shard groups (hybrid sharding, pyfast.parallel.zero.hybrid): Mesh(..., shard=N) cuts the
dp x cp ranks of each tp / pp coordinate (dp_cp_group, in its order: cp inner) into blocks of
N consecutive ones: shard_group is this rank's block (ZeRO shards over it: a node, when the
ranks of a node are consecutive, as torchrun numbers them), shard_replica_group the ranks at
this rank's place in every block (hybrid sharding all-reduces the shards over it). shard=None
(the default): shard_group is dp_cp_group and shard_replica_group a group of this rank alone.

Like torchtitan's ParallelDims it checks that the degrees multiply to the world size when
built; unlike picotron's process_group_manager it is no module-level global.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "cp", "tp")  # outermost first: the DeviceMesh's dimension order
REPLICA = "replica"  # the DeviceMesh dimension in front of DIMS when replicas > 1


def _degree(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Mesh: {name} must be an int >= 1, got {value!r}")
    return value


class Mesh:
    """dp x cp x tp x pp over `group` (None: the default group). Construction is collective
    over the default group when group is None (it creates the sub-groups, like dist.new_group),
    and over `group`'s ranks otherwise.

    Attributes: dp, cp, tp, pp (degrees), dp_rank, cp_rank, tp_rank, pp_rank (this rank's
    coordinates), dp_group, cp_group, tp_group, pp_group (process groups; a degree of 1 gives a
    group of one rank), dp_cp_group (the ranks with this rank's tp and pp coordinates: they
    hold the same parameters and average gradients; dp_group when cp == 1), device_mesh
    (torch's DeviceMesh, dims named "pp", "dp", "cp", "tp", with "replica" first when
    replicas > 1), rank and world (in `group`); replicas, replica_rank, replica_group (the
    ranks holding this rank's shard in every replica; a group of one rank when replicas == 1)
    and inner (dp x cp x tp x pp: the ranks of one replica).
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, group=None,
                 device_type: str | None = None, cp: int = 1, replicas: int = 1,
                 shard: int | None = None):
        self.dp, self.tp, self.pp = _degree("dp", dp), _degree("tp", tp), _degree("pp", pp)
        self.cp, self.replicas = _degree("cp", cp), _degree("replicas", replicas)
        self.inner = dp * cp * tp * pp
        if shard is not None:
            _degree("shard", shard)
            if (dp * cp) % shard:
                raise ValueError(f"Mesh: shard={shard} must divide dp x cp = {dp} x {cp} = "
                                 f"{dp * cp} (the ranks a shard group is cut from)")
        self.shard = shard
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs torch.distributed initialized (torchrun + "
                               "dist.init_process_group)")
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        R = replicas
        if R * self.inner != self.world:
            what = (f"replicas={R} x " if R > 1 else "") + f"dp={dp} x " + \
                (f"cp={cp} x " if cp > 1 else "") + f"tp={tp} x pp={pp}"
            raise ValueError(f"Mesh: {what} = {R * self.inner} ranks, but the world size is "
                             f"{self.world}")
        if device_type is None:  # NCCL groups serve CUDA tensors, gloo CPU ones
            nccl = dist.get_backend(group) == "nccl"
            device_type = "cuda" if nccl else "cpu"  # cpu-literal: DeviceMesh's type for gloo
        shape, names = (pp, dp, cp, tp), DIMS
        if R > 1:
            shape, names = (R, *shape), (REPLICA, *DIMS)
        whole = group is None or dist.get_world_size(group) == dist.get_world_size()
        if whole:
            self.device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        else:
            self.device_mesh = self._from_subgroup(group, device_type, shape, names)
        self.replica_rank, r = divmod(self.rank, self.inner)
        want = (r // (dp * cp * tp), (r // (cp * tp)) % dp, (r // tp) % cp, r % tp)
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = want
        if R > 1:
            want = (self.replica_rank, *want)
        coords = self.device_mesh.get_coordinate()
        if coords is not None and tuple(coords) != want:
            raise RuntimeError(f"Mesh: DeviceMesh placed rank {self.rank} at {tuple(coords)}, "
                               f"expected {want}")
        self.pp_group, self.dp_group, self.cp_group, self.tp_group = (
            self.device_mesh.get_group(d) for d in DIMS)
        # the replica groups are process groups of their own, never the DeviceMesh's: it hands
        # back the default group for a dimension spanning the world (replicas of one rank),
        # and DiLoCo's outer all-reduce runs behind the inner steps on a worker thread while
        # the main thread's collectives use the default group; gloo pairs operations on one
        # group by order, so sharing it mismatched them ("op.preamble.length <= op.nbytes.
        # 16384 vs 8" in a Streaming DiLoCo run, seen here)
        self._replica_group = None
        if R > 1:
            self._replica_group = (self._subgroups(group, shape, (0,)) if not whole else
                                   self._new_groups(shape, (0,)))
        self.shard_group = self._shard_replica = None
        if shard is not None and shard < dp * cp:  # (pp, dp x cp / N, N, tp) per replica
            lay = (*shape[:-3], dp * cp // shard, shard, tp)
            at = len(lay) - 2
            make = (lambda d: self._subgroups(group, lay, d)) if not whole else \
                (lambda d: self._new_groups(lay, d))
            self.shard_group, self._shard_replica = make((at,)), make((at - 1,))
        if cp == 1:
            self.dp_cp_group = self.dp_group
        elif whole:  # collective over the default group, like init_device_mesh
            self.dp_cp_group = self.device_mesh["dp", "cp"]._flatten("dp_cp").get_group()
        else:
            self.dp_cp_group = self._subgroups(group, shape, (len(shape) - 3, len(shape) - 2))
        if self.shard_group is None:  # no shard= (or N = dp x cp): the whole dp x cp group
            self.shard_group = self.dp_cp_group

    @staticmethod
    def _subgroups(group, shape, dims: tuple[int, ...]):
        """This rank's group along `dims` of the layout of `group`'s ranks, made with local
        synchronization (only its members call new_group), so ranks outside `group` need not
        take part."""
        ranks = torch.tensor(dist.get_process_group_ranks(group)).view(shape)
        size = 1
        for d in dims:
            size *= shape[d]
        rest = [d for d in range(len(shape)) if d not in dims]
        rows = ranks.permute(*rest, *dims).reshape(-1, size)  # one row per group along dims
        me, mine = dist.get_rank(), None
        for row in rows.tolist():  # every member creates its own rows, in the same order
            if me in row:
                mine = dist.new_group(row, use_local_synchronization=True)
        return mine

    @staticmethod
    def _new_groups(shape, dims: tuple[int, ...]):
        """This rank's group along `dims` of the default group's layout: every rank makes
        every row's group, in the same order (collective over the default group)."""
        ranks = torch.arange(dist.get_world_size()).view(shape)
        rest = [d for d in range(len(shape)) if d not in dims]
        size = 1
        for d in dims:
            size *= shape[d]
        mine = None
        for row in ranks.permute(*rest, *dims).reshape(-1, size).tolist():
            g = dist.new_group(row)
            if dist.get_rank() in row:
                mine = g
        return mine

    @classmethod
    def _from_subgroup(cls, group, device_type: str, shape, names=DIMS) -> DeviceMesh:
        """A DeviceMesh over `group`'s ranks only (see _subgroups)."""
        groups = [cls._subgroups(group, shape, (d,)) for d in range(len(shape))]
        ranks = torch.tensor(dist.get_process_group_ranks(group)).view(shape)
        return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)

    @property
    def coords(self) -> dict:
        return {"dp": self.dp_rank, "cp": self.cp_rank, "tp": self.tp_rank, "pp": self.pp_rank}

    @property
    def replica_group(self):
        """The ranks holding this rank's shard in every replica. With one replica a group of
        this rank alone, made on first use (local synchronization: only this rank takes part),
        so that a Mesh without replicas makes no more groups than it always did."""
        if self._replica_group is None:
            self._replica_group = dist.new_group([dist.get_rank()],
                                                 use_local_synchronization=True)
        return self._replica_group

    @property
    def shard_replica_group(self):
        """The ranks at this rank's place in every shard group of its dp x cp group (hybrid
        sharding's cross-node all-reduce); without shard groups a group of this rank alone,
        made on first use as replica_group's."""
        if self._shard_replica is None:
            self._shard_replica = dist.new_group([dist.get_rank()],
                                                 use_local_synchronization=True)
        return self._shard_replica

    @property
    def inner_mesh(self) -> DeviceMesh:
        """This replica's pp x dp x cp x tp DeviceMesh (device_mesh itself when replicas == 1)."""
        if self.replicas == 1:
            return self.device_mesh
        return self.device_mesh[DIMS]

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def __str__(self) -> str:
        cp, at = (f", cp={self.cp}", f", cp {self.cp_rank}") if self.cp > 1 else ("", "")
        rep, rat = ((f"replicas={self.replicas}, ", f"replica {self.replica_rank}, ")
                    if self.replicas > 1 else ("", ""))
        return (f"Mesh({rep}dp={self.dp}{cp}, tp={self.tp}, pp={self.pp}): rank {self.rank}/"
                f"{self.world} at {rat}dp {self.dp_rank}{at}, tp {self.tp_rank}, pp {self.pp_rank}")

    __repr__ = __str__
