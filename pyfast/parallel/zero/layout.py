"""The ZeRO layout: which rank owns which elements of each parameter, and where they sit in the
flat buffers that the reduce-scatter and the all-gather move. Everything else in
pyfast.parallel.zero (the optimizer, stage 3's gathers, the checkpoints) reads it from here.

Sharding, per parameter p of n elements (its flat, row-major view): like torch.chunk, or DTensor
Shard(0) of the flattened 1-D parameter. Shard length s = ceil(n / W); rank r owns elements
[r*s, min((r+1)*s, n)) -- possibly fewer than s, or none, on the last ranks (n=5, W=4: s=2,
lengths 2, 2, 1, 0). A checkpoint builds, per parameter, a DTensor of shape (n,) with Shard(0)
on a 1-D DeviceMesh of the group, whose local tensor is this rank's master shard
(ParamShard.start/.length); DTensor's own Shard(0) split of n over W ranks is exactly this one.

Units: the trainable parameters (requires_grad, tied ones once under their first name) go into
units. Stages 1/2: buckets of about bucket_mb in reverse registration order (the order backward
produces gradients, as pyfast.comm.buckets and DDP assume); stage 3: one unit per wrapped module
(pyfast.parallel.zero.stage3 decides the groups and passes them in).

A unit's flat fp32 buffer is W equal segments of S elements; segment r holds rank r's shard of
every parameter of the unit, each at an offset that is a multiple of `align` (the compressor's
block, 1 without a compressor), zeros in between and after. So
- a plain reduce-scatter of the buffer (comm.reduce_scatter: W equal chunks) hands rank r its
  segment: its shards, contiguous, no copy; an all-gather of the segments rebuilds the buffer;
- a compressor block never holds pieces of two parameters (each chunk is compressed from its
  own start, and S is a multiple of align): a parameter's compression error does not depend on
  its neighbours, as in DataParallel's buckets.
Copy-in of a gradient is one strided copy of grad.view(-1), seen as W rows of s (the last row
short), into buffer.view(W, S)[:, off:off+s]; copy-out after an all-gather is the same copy
backwards.

Cost of the padding: per parameter, W*s - n elements (< W) plus under `align` per segment;
uncompressed, a 37x129 weight at W=4 pads 3 of 4773 elements. With int8 (block 512) every shard
is padded to a multiple of 512: worth it only for parameters much larger than W*512.

This is the contract the checkpoint code depends on: ParamShard's fields and Layout.params
(FQN -> ParamShard) do not change meaning without changing it too. The optimizer side of it
(pyfast.parallel.zero.optimizer.ZeroOptimizer): `opt.layout` is this Layout; `opt.shards` maps
FQN -> this rank's fp32 master shard, a 1-D tensor of exactly ParamShard.length elements (no
padding; 0 elements on a rank that owns none), the tensor the inner optimizer steps and keys
opt.state by. opt.param_groups are the inner optimizer's: the user's groups with each parameter
replaced by its master shard, in the user's order (default: the trainable parameters in
registration order, module.parameters()), so opt.state_dict()'s integer indices are those a
plain torch optimizer on the same parameters would use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def shard_size(n: int, world: int) -> int:
    """s = ceil(n / W): torch.chunk's (and DTensor Shard(0)'s) chunk length."""
    return -(-n // world)


def shard_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank's shard in the flattened parameter of n elements."""
    s = shard_size(n, world)
    start = min(rank * s, n)
    return start, min(s, n - start)


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


@dataclass(frozen=True)
class ParamShard:
    """One parameter in the layout, as seen from rank `rank`.

    name: its FQN in the wrapped module (the first one for a tied parameter); n, shape: its
    element count and shape; s: ceil(n / W); unit: the index of its unit; offset: where its
    shard starts inside every segment of the unit's buffer; start, length: this rank's piece
    of the flattened parameter, [start, start+length)."""
    name: str
    n: int
    shape: tuple
    s: int
    unit: int
    offset: int
    start: int
    length: int


@dataclass
class Unit:
    """A set of parameters reduced and gathered together: one buffer of world * S fp32."""
    index: int
    params: list           # the nn.Parameter objects, in layout order
    shards: list           # their ParamShard, same order
    S: int                 # segment length: a multiple of align
    world: int
    rank: int
    module: object = None  # stage 3: the module whose forward gathers this unit
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"unit{self.index}"

    @property
    def numel(self) -> int:
        return self.world * self.S

    def new_buffer(self, device=None) -> torch.Tensor:
        """A zeroed full buffer (W segments)."""
        return torch.zeros(self.numel, dtype=torch.float32, device=device)

    def segment(self, buf: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank's segment of a full buffer (a view)."""
        r = self.rank if rank is None else rank
        return buf[r * self.S:(r + 1) * self.S]

    def copy_in(self, buf: torch.Tensor, i: int, src: torch.Tensor | None) -> None:
        """Scatter parameter i's full tensor `src` (any float dtype; None: zeros) into every
        segment of the full buffer `buf`: one strided copy for the full rows of s, one for the
        short last row. The padding after the last row is left as it is (zero from new_buffer
        and never written)."""
        sh = self.shards[i]
        if sh.s == 0:
            return
        cols = buf.view(self.world, self.S)[:, sh.offset:sh.offset + sh.s]
        rows, rem = divmod(sh.n, sh.s)
        if src is None:
            cols[:rows].zero_()
            if rem:
                cols[rows, :rem].zero_()
            return
        flat = src.detach().reshape(-1)
        cols[:rows].copy_(flat[:rows * sh.s].view(rows, sh.s))
        if rem:
            cols[rows, :rem].copy_(flat[rows * sh.s:])

    def copy_out(self, buf: torch.Tensor, i: int, dst: torch.Tensor) -> None:
        """The reverse of copy_in: parameter i's full tensor from a gathered full buffer into
        dst (n elements, contiguous, any float dtype)."""
        sh = self.shards[i]
        if sh.s == 0:
            return
        cols = buf.view(self.world, self.S)[:, sh.offset:sh.offset + sh.s]
        rows, rem = divmod(sh.n, sh.s)
        flat = dst.view(-1)
        flat[:rows * sh.s].view(rows, sh.s).copy_(cols[:rows])
        if rem:
            flat[rows * sh.s:].copy_(cols[rows, :rem])

    def shard_view(self, seg: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's piece (exactly `length` elements) of this rank's segment `seg`."""
        sh = self.shards[i]
        return seg[sh.offset:sh.offset + sh.length]


class Layout:
    """Units of parameters over a group of `world` ranks, seen from `rank`.

    groups: lists of (FQN, parameter), one per unit, in unit order (the order every rank
    reduces and gathers them in). units[i].params keeps that order. params: FQN -> ParamShard;
    of(p): the (Unit, index) of an nn.Parameter."""

    def __init__(self, groups: list, world: int, rank: int, align: int = 1,
                 modules: list | None = None):
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        self.world, self.rank, self.align = world, rank, align
        self.units: list[Unit] = []
        self.params: dict[str, ParamShard] = {}
        self._where: dict[int, tuple[Unit, int]] = {}
        for u, members in enumerate(groups):
            shards, off = [], 0
            for name, p in members:
                n = p.numel()
                s = shard_size(n, world)
                start, length = shard_range(n, world, rank)
                sh = ParamShard(name, n, tuple(p.shape), s, u, off, start, length)
                shards.append(sh)
                self.params[name] = sh
                off = _round_up(off + s, align)
            unit = Unit(u, [p for _, p in members], shards, _round_up(off, align), world, rank,
                        module=modules[u] if modules else None)
            self.units.append(unit)
            for i, p in enumerate(unit.params):
                self._where[id(p)] = (unit, i)

    def of(self, p: torch.Tensor) -> tuple[Unit, int]:
        return self._where[id(p)]

    def describe(self) -> list[str]:
        """What every rank must agree on (comm.agree): the units and their parameters."""
        return [f"{u.index}:{sh.name}:{sh.shape}:{sh.offset}:{u.S}"
                for u in self.units for sh in u.shards]

    @property
    def padded_numel(self) -> int:
        """Elements of all unit buffers (W segments each): what the reductions move."""
        return sum(u.numel for u in self.units)

    @property
    def numel(self) -> int:
        return sum(sh.n for sh in self.params.values())


def bucket_groups(named: list, bucket_mb: float, world: int, align: int = 1,
                  first_mb: float = 1.0) -> list:
    """Stages 1/2: (FQN, parameter) in reverse registration order cut into units of about
    bucket_mb of fp32 buffer (the first capped at first_mb so the link starts early, as in
    pyfast.comm.buckets)."""
    groups, members, size = [], [], 0
    first = min(first_mb, bucket_mb)
    for name, p in reversed(list(named)):
        members.append((name, p))
        size += world * _round_up(shard_size(p.numel(), world), align) * 4
        if size >= (first if not groups else bucket_mb) * 2 ** 20:
            groups.append(members)
            members, size = [], 0
    if members:
        groups.append(members)
    return groups
