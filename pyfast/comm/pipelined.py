"""The fast paths of the dense and sparse all-gather / two-phase algorithms: in place, chunked.

Same bytes, same rank order and same arithmetic as the reference functions in collectives.py
(`_gather_sum`, `_two_phase`), so results are bitwise equal to them; what changes is memory
traffic and overlap, measured on this 2-core machine at W=2 over a 1 Gbit/s emulated link with
a 64 MB fp32 gradient (bench/results/allreduce.txt):
- reduce into t itself (each chunk is overwritten only after it was compressed): a fresh 64 MB
  output costs 29 ms of page faults against 1.9 ms to zero existing memory;
- top-k decodes sparsely (scatter_add_): 0.2 ms instead of a dense 64 MB temporary per rank
  (34 ms each);
- top-k goes in parts too (_sparse_parts_into): one threshold pass over the whole gradient and
  one exchange of every part's size, then part i+1 is selected and part i-1 decoded while part
  i is on the wire. One padded gather after the whole selection ran at 2.2-3.3x its floor
  against 1.5-2.3x in parts, side by side under load (topk:0.01, W=2);
- fixed-layout payloads go in chunks of CHUNK elements with two (all-gather) or three
  (two-phase) chunks in flight, so compressing chunk i+1 and decoding chunk i-1 overlap the
  transfer of chunk i: int8 339 -> 270 ms (floor 270.5), fp16 -> 537 ms (floor 537).
Chunk bounds are multiples of the block size (times W for two-phase), so every quantization
block is the same block as in the unchunked reference. Every buffer is made on x's device
(new_empty / new_zeros of the chunk's bytes), so CUDA chunks never stage through the host.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pyfast import _dist
from pyfast._ranges import span
from pyfast.comm.dry import read
from pyfast.errors import NonFiniteGradient

# 512K-2M elements per chunk performed the same on 1 Gbit/s; 4M was slightly worse (277 ms).
DEFAULT_CHUNK = 1 << 21


def chunk_elems() -> int:
    return int(os.environ.get("PYFAST_COMM_CHUNK", DEFAULT_CHUNK))


def gather_sum_into(x, c, group, name, out, helpers):
    """out (fp32, contiguous, may be x) <- sum over ranks, in rank order."""
    world = dist.get_world_size(group)
    n = x.numel()
    if c.wire_bytes(n) is None:  # data-dependent size (top-k)
        if getattr(c.base, "compress_parts", None) is not None:
            return _sparse_parts_into(x, c, group, name, out, helpers)
        gathered = helpers.gather_checked(x, c, group, name)  # one padded gather
        out.zero_()
        for b in gathered:
            helpers.decode_add(c, b, out, x.dtype)  # top-k's decode_add is sparse
        return out
    align = c.align
    step = -(-chunk_elems() // align) * align
    bounds = [(a, min(n, a + step)) for a in range(0, n, step)]
    pending = []

    def finish(a, b, recv, h):
        h.wait()
        o = out[a:b]
        o.zero_()
        for buf in recv.view(world, -1):
            helpers.decode_add(c, buf, o, x.dtype)

    for i, (a, b) in enumerate(bounds):
        buf = helpers.to_bytes(c, x[a:b], f"{name}.{i}" if len(bounds) > 1 else name)
        recv = buf.new_empty(world * buf.numel())
        h = _dist.all_gather_single(recv, buf, group=group, async_op=True)
        pending.append((a, b, recv, h))
        if len(pending) > 2:  # two chunks in flight: the link never idles
            finish(*pending.pop(0))
    for p in pending:
        finish(*p)
    return out


def _sparse_parts_into(x, c, group, name, out, helpers):
    """A variable-size payload (top-k) in parts of CHUNK elements: one threshold pass over x
    and one exchange of every part's size (and the NaN/Inf flag), then part i+1 is selected
    and part i-1 decoded while part i is on the wire (c.base.compress_parts). Same selection,
    bytes per entry and rank-order sums as the one-gather reference (bitwise equal,
    tests/test_comm.py); the wire carries a 4-byte count per part and pads each part to its
    largest rank: 0.5% more bytes on lo at 64 MB, W=2."""
    world = dist.get_world_size(group)
    n = x.numel()
    step = -(-chunk_elems() // 8) * 8
    bounds = [(a, min(n, a + step)) for a in range(0, n, step)]
    ef = c.feedback._buffer(x, name) if c.feedback is not None else None
    flag, part = 0, None
    try:
        with span("pyfast.codec.compress"):  # the threshold pass; part(i) selects below
            sizes, part = c.base.compress_parts(x, bounds, name, ef)
    except NonFiniteGradient:  # tell every rank before anyone raises
        sizes, flag = [0] * len(bounds), 1
    mine = [flag, *sizes]
    meta = torch.tensor(mine, dtype=torch.int64, device=x.device)
    metas = meta.new_empty(world * meta.numel())
    _dist.all_gather_single(metas, meta, group=group)
    every = read(metas, mine * world, group)  # a dry run: every rank is this one
    rows = [every[r * len(mine):(r + 1) * len(mine)] for r in range(world)]
    helpers.refuse_nonfinite([row[0] for row in rows], name)
    pending = []

    def finish(a, b, got, recv, h):
        h.wait()
        o = out[a:b]
        o.zero_()
        for buf, size in zip(recv, got):
            helpers.decode_add(c, buf[:size], o, x.dtype)  # sparse: index_put_ accumulate

    for i, (a, b) in enumerate(bounds):
        got = [row[1 + i] for row in rows]
        pad = -(-max(got) // 8) * 8  # rows 8-byte aligned: typed views without a copy
        with span("pyfast.codec.compress"):
            buf = part(i)
        padded = buf.new_zeros(pad)
        padded[:buf.numel()] = buf
        recv = buf.new_empty(world, pad)
        h = _dist.all_gather_single(recv.view(-1), padded, group=group, async_op=True)
        pending.append((a, b, got, recv, h))
        if len(pending) > 2:  # two parts in flight: the link never idles
            finish(*pending.pop(0))
    for p in pending:
        finish(*p)
    return out


def two_phase_into(x, c, group, name, out, helpers):
    """Two-phase per chunk, three chunks in flight: chunk j's all-to-all, chunk j-1's reduce +
    all-gather and chunk j-2's decode overlap. out may be x itself."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.numel()
    align = c.align
    step = -(-chunk_elems() // (align * world)) * align * world
    bounds = [(a, min(n, a + step)) for a in range(0, n, step)]
    single = len(bounds) == 1  # then names match the reference's, for error feedback
    stage_a, stage_b = [], []

    def a2a(j, a, b):
        pieces = helpers.chunks(b - a, world, align)
        pre = name if single else f"{name}.{j}"
        send = [helpers.to_bytes(c, x[a + p:a + q], f"{pre}.{i}") for i, (p, q) in enumerate(pieces)]
        sizes = [s.numel() for s in send]
        recv = send[0].new_empty(sizes[rank] * world)
        h = dist.all_to_all_single(recv, torch.cat(send), [sizes[rank]] * world, sizes,
                                   group=group, async_op=True)
        stage_a.append((pre, a, pieces, sizes, recv, h))

    def reduce_gather(pre, a, pieces, sizes, recv, h):
        h.wait()
        p, q = pieces[rank]
        acc = torch.zeros(q - p, dtype=torch.float32, device=x.device)
        for buf in recv.split(sizes[rank]):
            helpers.decode_add(c, buf, acc, x.dtype)
        mine = helpers.to_bytes(c, acc.to(x.dtype), f"{pre}.sum")
        full = max(sizes)  # the last piece of a ragged chunk is shorter: pad to the largest
        padded = mine.new_zeros(full)
        padded[:mine.numel()] = mine
        got = mine.new_empty(full * world)
        h2 = _dist.all_gather_single(got, padded, group=group, async_op=True)
        stage_b.append((a, pieces, got, full, h2))

    def decode(a, pieces, got, full, h2):
        h2.wait()
        for (p, q), buf in zip(pieces, got.view(world, full)):
            if q > p:
                nb = c.wire_bytes(q - p)
                with span("pyfast.codec.decode"):
                    out[a + p:a + q].copy_(c.decompress(c.from_wire(buf[:nb], (q - p,), x.dtype)))

    for j, (a, b) in enumerate(bounds):
        a2a(j, a, b)
        if len(stage_a) > 1:
            reduce_gather(*stage_a.pop(0))
        if len(stage_b) > 1:
            decode(*stage_b.pop(0))
    while stage_a:
        reduce_gather(*stage_a.pop(0))
    while stage_b:
        decode(*stage_b.pop(0))
    return out
