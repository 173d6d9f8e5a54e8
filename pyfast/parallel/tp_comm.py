"""Tensor-parallel communication primitives, as autograd Functions.

Each is named for what it does to the tensor-parallel (TP) region, and each docstring names its
forward and its backward collective. They are conjugate pairs: the backward of one is the
forward of the other, which is what makes a column-parallel layer followed by a row-parallel one
communicate once per direction.

- Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, section 3): f = copy_to_tp_region,
  g = reduce_from_tp_region, plus gather/scatter along the hidden (last) dimension.
- Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.2): the
  all-reduce g is split into reduce-scatter + all-gather along the sequence dimension, so the
  activations between the TP regions (layer norm, dropout) are sharded and stored once.

`group` is a torch.distributed process group (None: the default group). Every rank of the group
must call the same primitive with the same shapes, as with any collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function


def tp_world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> int:
    dim = dim % x.dim() if x.dim() else 0
    if x.dim() == 0 or x.shape[dim] % world:
        raise ValueError(f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} is not "
                         f"divisible by the tensor-parallel size {world}")
    return dim


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # a fresh contiguous buffer: autograd may hand us an expanded or shared gradient
    out = x.clone(memory_format=torch.contiguous_format)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = tp_world(group)
    if world == 1:
        return x
    dim = _check_divisible(x, dim, world, "split")
    return x.chunk(world, dim)[rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, _ = tp_world(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    # gloo wants the output shaped (world * d0, ...) exactly
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x.contiguous(), group=group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(world, 0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, _ = tp_world(group)
    if world == 1:
        return x
    dim = _check_divisible(x, dim, world, "reduce-scatter")
    # reduce_scatter_single splits dim 0: bring `dim` to the front (one copy unless dim == 0)
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((src.shape[0] // world,) + tuple(src.shape[1:]), dtype=x.dtype,
                      device=x.device)
    dist.reduce_scatter_single(out, src, group=group)
    return out.movedim(0, dim).contiguous() if dim else out


class _CopyToTP(Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient. Megatron's `f`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(Function):
    """Forward: all-reduce (sum) of the partial results. Backward: identity. Megatron's `g`."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(Function):
    """Forward: keep this rank's slice of dimension `dim`. Backward: all-gather along `dim`."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group), None, None


class _GatherFromTP(Function):
    """Forward: all-gather along `dim`. Backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.dim, ctx.group), None, None


class _GatherFromSP(Function):
    """Sequence parallel, entering a TP region. Forward: all-gather along the sequence
    dimension. Backward: reduce-scatter (sum) along it (each rank's gradient is partial)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(Function):
    """Sequence parallel, leaving a TP region. Forward: reduce-scatter (sum) along the sequence
    dimension. Backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group), None, None


def copy_to_tp_region(x, group=None):
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x, group=None):
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x, group=None, dim: int = -1):
    return _ScatterToTP.apply(x, group, dim)


def gather_from_tp_region(x, group=None, dim: int = -1):
    return _GatherFromTP.apply(x, group, dim)


def gather_from_sequence_parallel_region(x, group=None, dim: int = 0):
    return _GatherFromSP.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x, group=None, dim: int = 0):
    return _ReduceScatterToSP.apply(x, group, dim)


def scatter_to_sequence_parallel_region(x, group=None, dim: int = 0):
    """Forward: keep this rank's slice of the sequence. Backward: all-gather (the inputs of a
    sequence-parallel region, e.g. the embedding output)."""
    return _ScatterToTP.apply(x, group, dim)
