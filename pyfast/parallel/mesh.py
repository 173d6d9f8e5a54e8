"""Mesh: the dp x tp x pp layout of a job's ranks, one validated object passed explicitly.

Built on torch's DeviceMesh (init_device_mesh) with Megatron's rank order: tp innermost (the
ranks of a tensor-parallel group are neighbours, on one node when nodes hold tp ranks), then
dp, then pp outermost. Global rank r sits at

    pp = r // (dp * tp),  dp = (r // tp) % dp,  tp = r % tp

    mesh = Mesh(dp=2, tp=2, pp=1)          # collective over the default group
    DataParallel(model, group=mesh.dp_group); parallelize(model, plan, group=mesh.tp_group)

Like torchtitan's ParallelDims it checks that the degrees multiply to the world size when
built; unlike picotron's process_group_manager it is no module-level global.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "tp")  # outermost first: the DeviceMesh's dimension order


def _degree(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Mesh: {name} must be an int >= 1, got {value!r}")
    return value


class Mesh:
    """dp x tp x pp over `group` (None: the default group). Construction is collective over the
    default group when group is None (it creates the sub-groups, like dist.new_group), and over
    `group`'s ranks otherwise.

    Attributes: dp, tp, pp (degrees), dp_rank, tp_rank, pp_rank (this rank's coordinates),
    dp_group, tp_group, pp_group (process groups; a degree of 1 gives a group of one rank),
    device_mesh (torch's DeviceMesh, dims named "pp", "dp", "tp"), rank and world (in `group`).
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, group=None,
                 device_type: str | None = None):
        self.dp, self.tp, self.pp = _degree("dp", dp), _degree("tp", tp), _degree("pp", pp)
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs torch.distributed initialized (torchrun + "
                               "dist.init_process_group)")
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if dp * tp * pp != self.world:
            raise ValueError(f"Mesh: dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, but the "
                             f"world size is {self.world}")
        if device_type is None:  # NCCL groups serve CUDA tensors, gloo CPU ones
            nccl = dist.get_backend(group) == "nccl"
            device_type = "cuda" if nccl else "cpu"  # cpu-literal: DeviceMesh's type for gloo
        shape = (pp, dp, tp)
        if group is None or dist.get_world_size(group) == dist.get_world_size():
            self.device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
        else:
            self.device_mesh = self._from_subgroup(group, device_type, shape)
        self.pp_rank, self.dp_rank, self.tp_rank = (self.rank // (dp * tp), (self.rank // tp) % dp,
                                                    self.rank % tp)
        coords = self.device_mesh.get_coordinate()
        if coords is not None and tuple(coords) != (self.pp_rank, self.dp_rank, self.tp_rank):
            raise RuntimeError(f"Mesh: DeviceMesh placed rank {self.rank} at {tuple(coords)}, "
                               f"expected {(self.pp_rank, self.dp_rank, self.tp_rank)}")
        self.pp_group, self.dp_group, self.tp_group = (self.device_mesh.get_group(d) for d in DIMS)

    @staticmethod
    def _from_subgroup(group, device_type: str, shape) -> DeviceMesh:
        """A DeviceMesh over `group`'s ranks only: each dimension's groups are made with local
        synchronization (only their members call new_group), so ranks outside `group` need not
        take part."""
        ranks = torch.tensor(dist.get_process_group_ranks(group)).view(shape)
        me = dist.get_rank()
        groups = []
        for d in range(3):
            moved = ranks.movedim(d, -1).reshape(-1, shape[d])  # one row per group along dim d
            mine = None
            for row in moved.tolist():  # every member creates its own rows, in the same order
                if me in row:
                    mine = dist.new_group(row, use_local_synchronization=True)
            groups.append(mine)
        return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=DIMS)

    @property
    def coords(self) -> dict:
        return {"dp": self.dp_rank, "tp": self.tp_rank, "pp": self.pp_rank}

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def __str__(self) -> str:
        return (f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}): rank {self.rank}/{self.world} "
                f"at dp {self.dp_rank}, tp {self.tp_rank}, pp {self.pp_rank}")

    __repr__ = __str__
