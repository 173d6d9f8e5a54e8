"""Context parallelism: one sequence's attention over the ranks of a group, each holding a shard
of the sequence ([B, H, S/N, D] of q, k and v), exact against dense attention on the whole one.

    q, k, v = (shard_sequence(t, group=cp, dim=2, layout="zigzag") for t in (q, k, v))
    out = context_parallel_attention(q, k, v, group=cp, causal=True, layout="zigzag")
    full = unshard_sequence(out, group=cp, dim=2, layout="zigzag")

Layouts (which tokens a rank holds): "contiguous" gives rank r the r-th of N equal chunks;
"zigzag" cuts the sequence into 2N chunks and gives rank r chunks r and 2N-1-r (Brandon et al.
2023, "Striped/zigzag" ring attention as in ring-flash-attention and Megatron-Core's CP), so
under a causal mask every rank has the same number of visible (query, key) pairs: with
contiguous chunks rank N-1 does N times rank 0's work and the others wait for it.
The layout has no default anywhere it changes a result (shard_sequence, unshard_sequence,
sequence_positions, a causal context_parallel_attention): a causal call on contiguous shards
that assumed zigzag gave a 50-69% wrong output and gradients with no error. It is not carried
with the shards either: q, k and v are computed from the sharded tokens (an attribute would
not survive the projections, a tensor subclass would have to survive every op), so the caller
says it where it is known, once per call.

Methods:
  "ring" (Liu et al. 2023, arXiv:2310.01889): keys and values travel around the ring while each
         rank attends its queries to the block it holds; blocks merge exactly by log-sum-exp
         (pyfast.parallel.ring_attention). Any number of heads.
  "ulysses" (Jacobs et al. 2023, DeepSpeed-Ulysses, arXiv:2309.14509): an all-to-all turns
         sequence shards into head shards, each rank attends over the whole sequence for H/N
         heads, and an all-to-all turns the output back. Needs H divisible by N.

Every rank checks its arguments and the ranks agree on them (pyfast.comm.agree: one 8-byte
all-gather) before anything is sent: a bad length, head count, dtype or head dim raises the
same error on every rank, naming the numbers, instead of a hang or a gloo abort on a message
of the wrong size. The agreement is reached once per group and arguments and reused by the
calls that repeat them, with no host sync (pyfast.parallel.cp_agree); a rank whose arguments
change alone still gets the error on every rank. CUDA tensors need a group with a CUDA
backend (NCCL), never gloo's host copy.
A rank that fails inside the ring (a dead neighbour, its own error) tells every rank of the ring
within 0.05 s (ring_attention.POLL), which raise CommError; the group's rings refuse later calls.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pyfast import _sequence
from pyfast._sequence import (LAYOUTS, METHODS, chunks_of, length_problem, n_chunks,
                              sequence_positions)
from pyfast._sequence import check_layout as _check_layout
from pyfast._sequence import world_rank as _world
from pyfast.comm.agree import agree
from pyfast.comm.collectives import check_backend
from pyfast.comm.failure import naming
from pyfast.ops.attention import check as check_qkv

from . import cp_agree
from .ring_attention import check_broken, ring_attention
from .ulysses import ulysses_attention

__all__ = ["LAYOUTS", "METHODS", "check_args", "chunks_of", "context_parallel_attention",
           "length_problem", "n_chunks", "sequence_positions", "shard_sequence",
           "unshard_sequence"]


def _agree_length(t: torch.Tensor, dim: int, world: int, layout: str, group, what: str,
                  full: bool) -> None:
    n = t.shape[dim] if full else t.shape[dim] * world
    bad = length_problem(n, world, layout) if full else None
    agree((tuple(t.shape), str(t.dtype), dim, layout), ValueError(bad) if bad else None, group,
          what=what, device=t.device)


def shard_sequence(t: torch.Tensor, group=None, dim: int = 2,
                   layout: str | None = None) -> torch.Tensor:
    """This rank's shard of `t` (the whole sequence along `dim`, the same on every rank): a
    contiguous copy (zigzag's two chunks side by side). layout: required, "zigzag" or
    "contiguous". Differentiable (the gradient lands in this rank's positions, zeros
    elsewhere). Collective only for the check."""
    _check_layout(layout, "shard_sequence")
    world, rank = _world(group)
    dim = dim % t.dim()
    if world > 1:
        _agree_length(t, dim, world, layout, group, "shard_sequence", full=True)
    elif t.shape[dim] % n_chunks(1, layout):
        raise ValueError(f"shard_sequence: {length_problem(t.shape[dim], 1, layout)}")
    pieces = t.chunk(n_chunks(world, layout), dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, world, layout)], dim)


class _Gather(torch.autograd.Function):
    """Shards -> the whole sequence on every rank; backward keeps this rank's shard of the
    gradient (DTensor's Shard -> Replicate redistribute: the gradient of a replicated tensor is
    taken to be the same on every rank, as when every rank computes the same loss from it)."""

    @staticmethod
    def forward(ctx, t, group, dim, layout):
        world, rank = _world(group)
        ctx.group, ctx.dim, ctx.layout = group, dim, layout
        parts = [torch.empty_like(t) for _ in range(world)]
        with naming("unshard_sequence"):
            dist.all_gather(parts, t.contiguous(), group=group)
        per = n_chunks(world, layout) // world  # chunks a rank holds
        pieces = [None] * n_chunks(world, layout)
        for r, part in enumerate(parts):
            for piece, c in zip(part.chunk(per, dim), chunks_of(r, world, layout)):
                pieces[c] = piece
        return torch.cat(pieces, dim)

    @staticmethod
    def backward(ctx, g):
        world, rank = _world(ctx.group)
        pieces = g.chunk(n_chunks(world, ctx.layout), ctx.dim)
        return (torch.cat([pieces[c] for c in chunks_of(rank, world, ctx.layout)], ctx.dim),
                None, None, None)


def unshard_sequence(t: torch.Tensor, group=None, dim: int = 2,
                     layout: str | None = None) -> torch.Tensor:
    """The whole sequence from every rank's shard (an all-gather), in natural order; inverse of
    shard_sequence, whose layout it requires. Differentiable (see _Gather: the gradient is
    taken as replicated)."""
    _check_layout(layout, "unshard_sequence")
    world, _ = _world(group)
    dim = dim % t.dim()
    if world == 1:
        return t
    check_backend(t.device, group, "unshard_sequence")
    _agree_length(t, dim, world, layout, group, "unshard_sequence", full=False)
    if layout == "zigzag" and t.shape[dim] % 2:
        raise ValueError(f"unshard_sequence: a zigzag shard holds two equal chunks, but its "
                         f"length along dim {dim} is {t.shape[dim]} (odd)")
    return _Gather.apply(t, group, dim, layout)


# ---------------------------------------------------------------- the attention
def _problem(q, k, v, world: int, causal: bool, method: str, layout: str):
    """This rank's own mistake (an exception, not raised yet) or None."""
    try:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        _check_layout(layout, when=" with causal=True")  # None: causal only (agree's prefix)
        check_qkv(q, k, v, "context_parallel_attention")
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"context_parallel_attention: q holds {q.shape[2]} tokens of the "
                             f"sequence and k/v {k.shape[2]}: self-attention shards must match")
        bad = length_problem(q.shape[2] * world, world, layout)
        if bad:
            raise ValueError(f"context_parallel_attention: shards of {q.shape[2]} tokens on "
                             f"{world} ranks: {bad}")
        if method == "ulysses" and q.shape[1] % world:
            raise ValueError(f"context_parallel_attention(ulysses): {q.shape[1]} heads are not "
                             f"divisible by the group's {world} ranks (use method='ring')")
    except (ValueError, TypeError) as e:
        return e
    return None


def _describe(q, k, v, causal, method, layout, scale) -> str:
    return (f"q {list(q.shape)} {q.dtype}, k {list(k.shape)} {k.dtype}, v {list(v.shape)} "
            f"{v.dtype}, causal={causal}, method={method}, layout={layout}, scale={scale}")


def _checked(q, k, v, group, world: int, causal: bool, method: str, layout: str):
    if world > 1:
        check_backend(q.device, group, "context_parallel_attention")
    return _problem(q, k, v, world, causal, method, layout)


def check_args(q, k, v, group, causal: bool, method: str, layout: str, scale) -> None:
    """Raise the same error on every rank of `group` if any rank's arguments are bad or the
    ranks' differ (shards of different lengths, dtypes, head dims, methods ...). The full check
    every time; context_parallel_attention runs it once per group and arguments (cp_agree)."""
    world, _ = _world(group)
    problem = _checked(q, k, v, group, world, causal, method, layout)
    agree(_describe(q, k, v, causal, method, layout, scale), problem, group,
          what="context_parallel_attention", device=q.device if world > 1 else None)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                               causal: bool = True, method: str = "ring",
                               layout: str | None = None, scale: float | None = None,
                               heads_per_pass: int | None = None,
                               backend: str | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys: q, k, v [B, H, S/N, D],
    this rank's shards in `layout` (shard_sequence's), the output [B, H, S/N, D] likewise.
    layout is required when causal (the mask depends on which tokens a rank holds; ValueError
    without it); without a mask any layout gives the same rows, and None means contiguous.
    Equal to F.scaled_dot_product_attention(full q, k, v, is_causal=causal) sharded. Collective
    over `group` (None: the default group); differentiable in q, k and v.

    heads_per_pass (ring): the ring runs over groups of this many heads one after another, so its
    send/receive buffers hold that many heads (memory) and only the last group's final gradient
    transfer is not hidden behind compute; default: enough heads for >= 1 MB messages.
    backend: the block kernel's (pyfast.ops.attention; default: cpp on CPU, triton on CUDA)."""
    if not causal and layout is None:  # keys in any order give the same rows; the lightest check
        layout = "contiguous"
    world, _ = _world(group)
    if world > 1:
        cp_agree.refuse(group)  # ranks that disagreed: the same error on every rank, at once
        check_broken(group)  # a ring that failed: its peers may be dead or a step behind
    # the arguments, agreed once per group and reused while they stay the same (cp_agree)
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
               v.device, causal, method, layout, scale)
    except AttributeError:  # not tensors: never a hit, the full check names the problem
        key = object()
    cp_agree.check(key, group, world, q.device, "context_parallel_attention",
                   lambda: _describe(q, k, v, causal, method, layout, scale),
                   lambda: _checked(q, k, v, group, world, causal, method, layout))
    if world == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if method == "ulysses":
        return ulysses_attention(q, k, v, group, causal, layout, scale)
    return ring_attention(q, k, v, group, causal, layout, scale, heads_per_pass, backend)


_sequence.set_attention(context_parallel_attention)  # models reach it through pyfast._sequence
