"""reduce_scatter and all_gather through a compressor: the two halves of all_reduce's two-phase
algorithm, apart, for a sharded optimizer (reduce-scatter gradients, update a shard, all-gather).

reduce_scatter splits t's flat view into W equal chunks; rank i gets chunk i of the sum.
- none: the backend's reduce-scatter, in fp32 (gloo has it in torch 2.13: reduce_scatter_single;
  reduce_scatter_tensor is deprecated there).
- fp16 / bf16 / int8 / int4 / fp8 / sign: two-phase's first phase. Each destination chunk is
  compressed under f"{name}.{i}" (so error feedback memory is keyed as in two-phase),
  all-to-all, decoded and summed in fp32 in rank order: the same bytes and order everywhere.
- topk / randomk: the same with sparse payloads; their sizes and a NaN/Inf flag go first.
- powersgd: refused, its factors need the whole matrix.
all_gather compresses t under `name` and decodes every rank's bytes, the own ones included,
so every rank holds bit-identical out.

Before any data moves, the ranks check that they agree (shape, dtype, out; comm.agree): a
mismatch would otherwise hang a collective or pair chunks of different tensors. The check is one
all-gather of 8 bytes: 0.6 ms at W=2 on this 2-core machine (loaded), against 1.6 ms for a whole
int8 reduce_scatter of 4K elements and 18 ms at 4M: it matters only for tiny tensors.

As in collectives.py: every buffer, the digests and counts included, is on t's device; CUDA
tensors need a group with a CUDA backend other than gloo (check_backend); a backend failure is
a failure.CommError naming the operation.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pyfast._ranges import ranged, span
from pyfast import _dist

import pyfast.compress as C
from pyfast.comm.agree import agree, rank_by_rank
from pyfast.comm.collectives import (OPS, Handle, NonFiniteGradient, _all_gather_var, _bytes,
                                     _decode_add, _label, _world, check_backend, choose)
from pyfast.comm.failure import naming
from pyfast.comm.dry import read

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SPARSE = ("sparse-allgather", "shared-index")  # choose()'s names for topk and randomk


def _own_problem(t, out, want, why: str, world: int) -> Exception | None:
    """This rank's mistake in the arguments (not raised yet: agree raises it everywhere)."""
    if t.dtype not in FLOATS:
        return TypeError(f"takes float32, bfloat16 or float16 tensors, got {t.dtype}")
    if out.dtype != t.dtype:
        return TypeError(f"out is {out.dtype} but t is {t.dtype}: they must match")
    if want is None:
        return ValueError(f"t has {t.numel()} elements, not divisible by the world size {world}")
    if out.numel() != want:
        return ValueError(f"out has {out.numel()} elements, expected {want} ({why})")
    if not out.is_contiguous():
        return ValueError("out must be contiguous")
    return None


def _agree(what: str, name: str, t, out, want, why: str, group) -> None:
    """The same error on every rank if any rank's arguments are bad or its t differs from rank
    0's in shape or dtype (comm.agree: one all-gather of a digest on t's device)."""
    world, _ = _world(group)
    agree(f"{tuple(t.shape)} {t.dtype}", _own_problem(t, out, want, why, world), group,
          what=f"{what}({name!r})" if name else what, device=t.device,
          differ=lambda descs: "tensors differ across ranks: " + rank_by_rank(descs))


@ranged("pyfast.codec.compress")
def _compress_checked(c, parts, names):
    """Payloads, and 1 instead if a sparse compressor refused NaN/Inf (then every rank must
    hear of it before anyone raises, as in collectives._gather_checked)."""
    try:
        return [c.compress(x, nm) for x, nm in zip(parts, names)], 0
    except NonFiniteGradient:
        return [], 1


def _raise_nonfinite(flags, name: str) -> None:
    bad = [r for r, f in enumerate(flags) if f]
    if bad:
        raise NonFiniteGradient(f"{name or 'tensor'}: NaN/Inf gradient on rank(s) {bad}")


def _dense_rs(parts, names, c, group, name, acc):
    world, _ = _world(group)
    send = [_bytes(c, x, nm) for x, nm in zip(parts, names)]
    size = send[0].numel()  # equal chunks and a fixed layout: every payload has this size
    recv = send[0].new_empty(world * size)
    dist.all_to_all_single(recv, torch.cat(send), group=group)
    acc.zero_()
    for buf in recv.split(size):
        _decode_add(c, buf, acc, parts[0].dtype)


def _sparse_rs(parts, names, c, group, name, acc):
    world, rank = _world(group)
    ps, flag = _compress_checked(c, parts, names)
    send = [c.to_wire(p) for p in ps]
    out_sizes = [s.numel() for s in send] if send else [0] * world
    mine = torch.tensor([flag] + out_sizes, device=parts[0].device)
    every = mine.new_empty(world, world + 1)
    _dist.all_gather_single(every.view(-1), mine, group=group)
    rows = read(every, [[flag] + out_sizes] * world, group)  # a dry run: every rank is this one
    _raise_nonfinite([r[0] for r in rows], name)
    sizes = [r[1 + rank] for r in rows]
    recv = send[0].new_empty(sum(sizes))
    dist.all_to_all_single(recv, torch.cat(send), sizes, out_sizes, group=group)
    acc.zero_()
    meta = ps[rank].meta  # randomk: every rank derived this same seed for chunk `rank`
    for buf in recv.split(sizes):
        with span("pyfast.codec.decode"):
            acc += c.decompress(c.from_wire(buf, acc.shape, parts[0].dtype, meta)).float()


@ranged("pyfast.comm.reduce_scatter")
def _reduce_scatter(out, t, c, group, op, name):
    world, _ = _world(group)
    n = t.numel()
    per = n // world
    _agree("reduce_scatter", name, t, out, None if n % world else per,
           f"t.numel() {n} / world {world}", group)
    if n == 0:
        return out
    x = t.reshape(-1)
    # Sum straight into out when it is fp32: a fresh temporary costs page faults (pipelined.py).
    # On the compressed paths out may even alias t: every chunk is compressed before out is
    # written. The backend's reduce-scatter makes no such promise.
    acc = out.view(-1) if out.dtype == torch.float32 else out.new_empty(per, dtype=torch.float32)
    kind = choose(c, n, world)
    if kind == "native":  # fp32 sums for 16-bit inputs too, as all_reduce does
        # all_to_all_single + a local fp32 sum measured faster than gloo's reduce-scatter at
        # W=2 on this loaded 2-core machine (24 vs 29 ms for 4M elements, 94 vs 145 ms for 8M):
        # worth a side-by-side benchmark before choosing it over the backend's own.
        _dist.reduce_scatter_single(acc, x.to(torch.float32), group=group)
    else:
        fn = _sparse_rs if kind in SPARSE else _dense_rs
        fn(list(x.split(per)), [f"{name}.{i}" for i in range(world)], c, group, name, acc)
    if op == "avg":
        acc.div_(world)
    if acc.data_ptr() != out.data_ptr():
        out.view(-1).copy_(acc)
    return out


@ranged("pyfast.comm.all_gather")
def _all_gather(out, t, c, group, name):
    world, _ = _world(group)
    n = t.numel()
    _agree("all_gather", name, t, out, world * n, f"world {world} x t.numel() {n}", group)
    if n == 0:
        return out
    x, flat = t.reshape(-1), out.view(-1)
    kind = choose(c, n, world)
    if kind == "native":
        _dist.all_gather_single(flat, x, group=group)
        return out
    if kind in SPARSE:
        ps, flag = _compress_checked(c, [x], [name])
        buf = c.to_wire(ps[0]) if ps else x.new_empty(0, dtype=torch.uint8)
        bufs, flags = _all_gather_var(buf, group, flag)
        _raise_nonfinite(flags, name)
        meta = ps[0].meta
    else:
        buf = _bytes(c, x, name)
        recv = buf.new_empty(world * buf.numel())
        _dist.all_gather_single(recv, buf, group=group)
        bufs, meta = recv.split(buf.numel()), {}
    for r, buf in enumerate(bufs):
        with span("pyfast.codec.decode"):
            flat[r * n:(r + 1) * n] = c.decompress(c.from_wire(buf, (n,), t.dtype, meta))
    return out


def _start(async_op: bool, op: str, fn, *args):
    """fn(*args) now, or on all_reduce's FIFO worker when async_op; a backend failure either way
    is a CommError naming `op`."""
    fn = _named(op, fn)
    if not async_op:
        return fn(*args)
    return Handle.on_worker(fn, *args)  # all_reduce's FIFO worker: every rank issues in order


def _named(op: str, fn):
    def run(*args):
        with naming(op):
            return fn(*args)
    return run


def _compressor(spec, refusal: str):
    c = C.get(spec)
    if choose(c, 0, 1) == "powersgd":
        raise ValueError(refusal)
    return c


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, compressor=None, group=None,
                   op: str = "sum", async_op: bool = False, name: str = ""):
    """out <- chunk `rank` of the sum (or average) over ranks of t's flat view cut into W equal
    chunks, through `compressor` (None, a spec or a Compressor). t.numel() must divide by W;
    out has t's dtype and numel / W elements. Returns out, or a handle whose wait() returns out
    when async_op. `name` keys per-tensor compressor state, as in all_reduce."""
    if op not in OPS:
        raise ValueError(f"reduce_scatter: op must be one of {OPS}, got {op!r}")
    c = _compressor(compressor, "reduce_scatter: powersgd factors the whole matrix, not a "
                    "chunk of it; use all_reduce")
    what = f"reduce_scatter of {_label(name, t)} ({c.spec})"
    check_backend(t.device, group, what)
    return _start(async_op, what, _reduce_scatter, out, t, c, group, op, name)


def all_gather(out: torch.Tensor, t: torch.Tensor, compressor=None, group=None,
               async_op: bool = False, name: str = ""):
    """out <- every rank's t, in rank order, through `compressor`; out has t's dtype and
    W * t.numel() elements, bit-identical on every rank. Returns out, or a handle whose wait()
    returns out when async_op."""
    c = _compressor(compressor, "all_gather: powersgd's factors exist only as sums over ranks "
                    "(all_reduce); it has no per-rank payload to gather")
    what = f"all_gather of {_label(name, t)} ({c.spec})"
    check_backend(t.device, group, what)
    return _start(async_op, what, _all_gather, out, t, c, group, name)
