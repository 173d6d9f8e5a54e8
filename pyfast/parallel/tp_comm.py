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

Failures: a collective that fails (a dead peer, the group's timeout) raises CommError naming the
primitive, its direction and the caller (`guard`, a CommGuard: the layers pass theirs, which
also puts the layer in its broken state, so it refuses every later collective instead of
pairing a mismatched one with its peers).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from pyfast._ranges import ranged
from pyfast import _dist
from torch.autograd import Function

from pyfast.comm.failure import Breaker, naming


def tp_world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


class CommGuard:
    """Who communicates (`who`, named in errors) and the Breaker that fails with it (None: only
    name the failure). guard(op) refuses at once if broken, else runs the block, re-raising a
    backend failure as CommError "<who>: <op> failed on rank r: ..." and tripping the breaker."""

    def __init__(self, who: str, breaker: Breaker | None = None):
        self.who, self.breaker = who, breaker

    @contextlib.contextmanager
    def __call__(self, op: str):
        op = f"{self.who}: {op}" if self.who else op
        if self.breaker is None:
            with naming(op):
                yield
            return
        self.breaker.check()
        with self.breaker.guard(op):
            yield


def _guarded(guard: CommGuard | None, op: str):
    return guard(op) if guard is not None else naming(op)


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> int:
    dim = dim % x.dim() if x.dim() else 0
    if x.dim() == 0 or x.shape[dim] % world:
        raise ValueError(f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} is not "
                         f"divisible by the tensor-parallel size {world}")
    return dim


@ranged("pyfast.tp.all_reduce")
def _all_reduce(x: torch.Tensor, group, guard=None, op="all-reduce") -> torch.Tensor:
    # a fresh contiguous buffer: autograd may hand us an expanded or shared gradient
    out = x.clone(memory_format=torch.contiguous_format)
    if dist.get_world_size(group) > 1:
        with _guarded(guard, op):
            dist.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = tp_world(group)
    if world == 1:
        return x
    dim = _check_divisible(x, dim, world, "split")
    return x.chunk(world, dim)[rank].contiguous()


@ranged("pyfast.tp.all_gather")
def _gather(x: torch.Tensor, dim: int, group, guard=None, op="all-gather") -> torch.Tensor:
    world, _ = tp_world(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    # gloo wants the output shaped (world * d0, ...) exactly
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    with _guarded(guard, op):
        _dist.all_gather_single(out, x.contiguous(), group=group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(world, 0), dim=dim)


@ranged("pyfast.tp.reduce_scatter")
def _reduce_scatter(x: torch.Tensor, dim: int, group, guard=None,
                    op="reduce-scatter") -> torch.Tensor:
    world, _ = tp_world(group)
    if world == 1:
        return x
    dim = _check_divisible(x, dim, world, "reduce-scatter")
    # reduce_scatter_single splits dim 0: bring `dim` to the front (one copy unless dim == 0)
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((src.shape[0] // world,) + tuple(src.shape[1:]), dtype=x.dtype,
                      device=x.device)
    with _guarded(guard, op):
        _dist.reduce_scatter_single(out, src, group=group)
    return out.movedim(0, dim).contiguous() if dim else out


class _CopyToTP(Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient. Megatron's `f`."""

    @staticmethod
    def forward(ctx, x, group, guard):
        ctx.group, ctx.guard = group, guard
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group, ctx.guard,
                           "backward all-reduce (copy_to_tp_region)"), None, None


class _ReduceFromTP(Function):
    """Forward: all-reduce (sum) of the partial results. Backward: identity. Megatron's `g`."""

    @staticmethod
    def forward(ctx, x, group, guard):
        return _all_reduce(x, group, guard, "forward all-reduce (reduce_from_tp_region)")

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ScatterToTP(Function):
    """Forward: keep this rank's slice of dimension `dim`. Backward: all-gather along `dim`."""

    @staticmethod
    def forward(ctx, x, group, dim, guard):
        ctx.group, ctx.dim, ctx.guard = group, dim, guard
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group, ctx.guard,
                       "backward all-gather (scatter_to_tp_region)"), None, None, None


class _GatherFromTP(Function):
    """Forward: all-gather along `dim`. Backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim, guard):
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group, guard, "forward all-gather (gather_from_tp_region)")

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.dim, ctx.group), None, None, None


class _GatherFromSP(Function):
    """Sequence parallel, entering a TP region. Forward: all-gather along the sequence
    dimension. Backward: reduce-scatter (sum) along it (each rank's gradient is partial)."""

    @staticmethod
    def forward(ctx, x, group, dim, guard):
        ctx.group, ctx.dim, ctx.guard = group, dim, guard
        return _gather(x, dim, group, guard,
                       "forward all-gather (gather_from_sequence_parallel_region)")

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group, ctx.guard,
                               "backward reduce-scatter (gather_from_sequence_parallel_region)"
                               ), None, None, None


class _ReduceScatterToSP(Function):
    """Sequence parallel, leaving a TP region. Forward: reduce-scatter (sum) along the sequence
    dimension. Backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group, dim, guard):
        ctx.group, ctx.dim, ctx.guard = group, dim, guard
        return _reduce_scatter(
            x, dim, group, guard,
            "forward reduce-scatter (reduce_scatter_to_sequence_parallel_region)")

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group, ctx.guard,
                       "backward all-gather (reduce_scatter_to_sequence_parallel_region)"
                       ), None, None, None


# `guard`: a CommGuard naming the caller (and breaking it) on a failed collective; None: the
# error still names the primitive (CommError), nothing is broken.
def copy_to_tp_region(x, group=None, guard: CommGuard | None = None):
    return _CopyToTP.apply(x, group, guard)


def reduce_from_tp_region(x, group=None, guard: CommGuard | None = None):
    return _ReduceFromTP.apply(x, group, guard)


def scatter_to_tp_region(x, group=None, dim: int = -1, guard: CommGuard | None = None):
    return _ScatterToTP.apply(x, group, dim, guard)


def gather_from_tp_region(x, group=None, dim: int = -1, guard: CommGuard | None = None):
    return _GatherFromTP.apply(x, group, dim, guard)


def gather_from_sequence_parallel_region(x, group=None, dim: int = 0,
                                         guard: CommGuard | None = None):
    return _GatherFromSP.apply(x, group, dim, guard)


def reduce_scatter_to_sequence_parallel_region(x, group=None, dim: int = 0,
                                               guard: CommGuard | None = None):
    return _ReduceScatterToSP.apply(x, group, dim, guard)


def scatter_to_sequence_parallel_region(x, group=None, dim: int = 0,
                                        guard: CommGuard | None = None):
    """Forward: keep this rank's slice of the sequence. Backward: all-gather (the inputs of a
    sequence-parallel region, e.g. the embedding output)."""
    return _ScatterToTP.apply(x, group, dim, guard)
