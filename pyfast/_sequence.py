"""Which tokens of a sequence each rank of a context-parallel group holds (the layouts), and
the one seam through which models reach context-parallel attention.

Below both pyfast.parallel (context, ulysses, ring_attention: the attention itself) and
pyfast.models (positions of a shard, attention routed through the group): DESIGN.md's models
do not import parallel/. pyfast.parallel.context re-exports everything here; it is the public
home of these names.

Layouts: "contiguous" gives rank r the r-th of N equal chunks; "zigzag" cuts the sequence into
2N chunks and gives rank r chunks r and 2N-1-r (see pyfast.parallel.context).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")
METHODS = ("ring", "ulysses")


def world_rank(group) -> tuple[int, int]:
    """(size, rank) of `group` (None: the default group); (1, 0) outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_layout(layout: str | None, what: str = "", when: str = "") -> None:
    if layout is None:
        raise ValueError(f"{what + ': ' if what else ''}layout= is required{when} "
                         f"({' or '.join(map(repr, LAYOUTS))}: how "
                         "the shards were cut, shard_sequence's layout); there is no default, "
                         "since guessing wrong gives a wrong result without an error")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """Which of the sequence's equal chunks `rank` holds, in the order it holds them: (rank,) of
    `world` chunks (contiguous) or (rank, 2*world-1-rank) of 2*world (zigzag)."""
    check_layout(layout)
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def n_chunks(world: int, layout: str) -> int:
    check_layout(layout)
    return world if layout == "contiguous" else 2 * world


def length_problem(seq_len: int, world: int, layout: str) -> str | None:
    """Why a sequence of seq_len tokens cannot be sharded so, or None."""
    n = n_chunks(world, layout)
    if seq_len % n:
        return (f"sequence length {seq_len} is not divisible by {n} "
                f"({'2 x ' if layout == 'zigzag' else ''}{world} ranks, layout {layout!r})")
    return None


def sequence_positions(seq_len: int, group=None, layout: str | None = None, *,
                       rank: int | None = None, world: int | None = None,
                       device=None) -> torch.Tensor:
    """The global positions (int64) of the tokens a rank holds, in its shard's order: what its
    rotary or learned position embeddings must use. seq_len is the whole sequence's length;
    layout (required) the shards'."""
    check_layout(layout, "sequence_positions")
    if rank is None or world is None:
        w, r = world_rank(group)
        world, rank = world or w, rank if rank is not None else r
    bad = length_problem(seq_len, world, layout)
    if bad:
        raise ValueError(f"sequence_positions: {bad}")
    size = seq_len // n_chunks(world, layout)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in chunks_of(rank, world, layout)])


# The attention a model's context-parallel layers call (q, k, v, group, causal=, method=,
# layout=, scale=): pyfast.parallel.context.context_parallel_attention, which puts itself here
# when imported. A seam in the manner of transformers' AttentionInterface (which the HF models'
# "pyfast_cp" goes through): models name what they need, the layer that has it provides it.
_attention = None


def set_attention(fn) -> None:
    global _attention
    _attention = fn


def attention():
    """The context-parallel attention function; RuntimeError naming the fix if no module that
    provides one was imported."""
    if _attention is None:
        raise RuntimeError("context parallelism needs pyfast.parallel (it provides "
                           "context_parallel_attention, which models do not import): "
                           "`import pyfast.parallel` before model.context_parallel(...)")
    return _attention
