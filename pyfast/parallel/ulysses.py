"""DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all turns q, k, v from
sequence shards [B, H, S/N, D] into head shards [B, H/N, S, D], each rank attends over the whole
sequence for its heads (F.scaled_dot_product_attention: aten's flash kernel on CPU, flash or
memory-efficient attention on CUDA), and an all-to-all turns the output back. Four all-to-alls
of one shard each forward (q, k, v, out) and four backward, whatever N: on a fast link it needs
no ring, but H must be divisible by N.

The gathered sequence comes in rank order, so under the zigzag layout its chunks are put in
natural order before the causal attention (one index_select) and back after it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pyfast._ranges import ranged
from pyfast._sequence import chunks_of, n_chunks
from pyfast.comm.failure import naming

from . import cp_agree

POLL = 0.05  # seconds between reads of the agreement while an all-to-all keeps a rank waiting


@ranged("pyfast.cp.all_to_all")
def _all_to_all(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    """Split x along `scatter` into N pieces, piece j to rank j; concatenate what arrives from
    ranks 0..N-1 along `gather`."""
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, scatter)).contiguous()  # [N, ...piece]
    recv = torch.empty_like(send)
    with naming("context_parallel_attention(ulysses) all_to_all"):
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        if cp_agree.settle(group):  # unread agreement: a rank may never join (cp_agree)
            cp_agree.wait_polling(work, lambda: cp_agree.settle(group), POLL)
        else:
            work.wait()
    return torch.cat(recv.unbind(0), gather)


class AllToAll(torch.autograd.Function):
    """Split along `scatter`, gather along `gather` (dims 1 = heads, 2 = sequence: sequence
    shards -> head shards is (1, 2), back is (2, 1)); backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int):
        ctx.args = (group, scatter, gather)
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, g):
        group, scatter, gather = ctx.args
        return _all_to_all(g, group, gather, scatter), None, None, None


def _natural_order(s: int, world: int, layout: str, device) -> torch.Tensor:
    """perm with gathered[:, :, perm] in natural order (gathered = ranks' shards in rank order)."""
    size = s // n_chunks(world, layout)
    held = [c for r in range(world) for c in chunks_of(r, world, layout)]  # chunk at each slot
    slot_of = {c: i for i, c in enumerate(held)}
    return torch.cat([torch.arange(slot_of[c] * size, (slot_of[c] + 1) * size, device=device)
                      for c in range(len(held))])


def ulysses_attention(q, k, v, group, causal: bool, layout: str, scale) -> torch.Tensor:
    world = dist.get_world_size(group)
    qh, kh, vh = (AllToAll.apply(t, group, 1, 2) for t in (q, k, v))  # -> head shards
    reorder = causal and layout == "zigzag"  # without a mask, key order does not matter
    if reorder:
        perm = _natural_order(qh.shape[2], world, layout, q.device)
        qh, kh, vh = (t.index_select(2, perm) for t in (qh, kh, vh))
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    if reorder:
        o = o.index_select(2, torch.argsort(perm))
    return AllToAll.apply(o, group, 2, 1)  # -> sequence shards
