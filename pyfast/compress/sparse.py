"""topk:R and randomk:R: send a fraction R of the entries (values + indices, or values only)."""
from __future__ import annotations

import math

import torch

from pyfast.compress.base import (Compressor, NonFiniteGradient, Payload, StepCounter, aligned,
                                  check_float, check_out, derive_seed, fill, flat)
from pyfast.ops import topk


def _scatter(p: Payload, idx: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Zeros with the sent values at idx: into out (checked) or a new tensor of p's shape."""
    if out is not None:
        check_out(p, out)
    into = flat(out) if out is not None else None
    if out is not None and into is None:  # no flat view of out: scatter, then copy
        return fill(out, _scatter(p, idx, None))
    y = into.zero_() if into is not None else torch.zeros(p.numel, dtype=p.dtype, device=idx.device)
    y[idx.long()] = p.tensors["values"].to(p.dtype)
    return out if out is not None else y.view(p.shape)


class TopK(Compressor):
    """The largest-magnitude ~R*n entries (Aji & Heafield 2017; sampled threshold as in Deep
    Gradient Compression, Lin et al. 2018). Wire: values in x's dtype + int32 indices + a
    4-byte count, since the count varies from step to step.

    Bound: the sent entries are exact, the rest 0; no dropped entry is larger in magnitude than
    a sent one; ceil(k/2) <= sent <= floor(3k/2) for k = max(1, round(R n)). NaN/Inf raise
    NonFiniteGradient (a ValueError): kept or dropped, they would vanish into a value or the
    feedback."""
    algorithm, per_tensor = "sparse-allgather", True

    def __init__(self, ratio: float):
        self.ratio = ratio
        self.spec = f"topk:{ratio:g}"

    def _select(self, x, ef=None):
        check_float(x, self.spec)
        # with ef, fused: ef <- (x + ef) - sent, one pass; NaN/Inf: topk raises NonFiniteGradient
        values, idx = topk.topk(x, self.ratio, ef)
        return Payload({"indices": idx, "values": values}, x.shape, x.dtype, header_bytes=4)

    def compress(self, x, name=""):
        return self._select(x)

    def compress_with_feedback(self, x, ef, name="", out=None):
        if out is not None and out is not ef:  # the fused kernel updates in place
            ef = out.copy_(ef)
        return self._select(x, ef)

    def compress_parts(self, x, bounds, name="", ef=None):
        """compress(x) (with ef: compress_with_feedback(x, ef)) in parts, for a collective that
        sends part i while it selects part i+1 (pyfast.comm.pipelined): (sizes, part), the
        wire size of each part [a, b) of `bounds` and part(i) -> its wire bytes, the payload of
        x[a:b] (indices relative to a). Call part(i) once each, in order (ef moves part by
        part). Together the parts hold exactly compress(x)'s selection: one threshold over all
        of x, ties past the cap cut in index order. NaN/Inf raise NonFiniteGradient here,
        before ef moves."""
        check_float(x, self.spec)
        x = x.reshape(-1)
        if x.numel() == 0:
            caps = [0] * len(bounds)
        elif x.is_meta:  # a dry run: topk's largest accepted selection, spread over the parts
            hi = topk.target(x.numel(), self.ratio)[2]
            caps = [round(hi * b / x.numel()) - round(hi * a / x.numel()) for a, b in bounds]
        else:
            t, counts, limit = topk.threshold(x, self.ratio, ef, bounds)
            caps = []
            for c in counts:  # the global cap, in index order
                caps.append(min(c, limit - sum(caps)))
        isz = x.element_size()

        def part(i):
            (a, b), m = bounds[i], caps[i]
            if x.is_meta or x.numel() == 0:
                values, idx = x.new_empty(m), torch.empty(m, dtype=torch.int32, device=x.device)
            else:  # with ef, called for every part (m = 0 too): it stores ef = r
                values, idx = topk.topk_select(x[a:b], ef[a:b] if ef is not None else None, t, m)
            return self.to_wire(Payload({"indices": idx, "values": values}, torch.Size([b - a]),
                                        x.dtype, header_bytes=4))
        return [4 + m * (isz + 4) for m in caps], part

    def decompress(self, p, out=None):
        return _scatter(p, p.tensors["indices"], out)

    def decode_add(self, p, out):
        """Sparse: out[indices] += values, no dense temporary. The indices are distinct, so
        each element gets one add whatever the kernel: scatter_add_ took 0.2 ms for 169K
        entries into 16M (one thread) where index_put_(accumulate=True) took 2-5.8 ms."""
        out.view(-1).scatter_add_(0, p.tensors["indices"].long(),
                                  p.tensors["values"].to(torch.float32))
        return out

    def to_wire(self, p):
        idx = p.tensors["indices"]
        count = torch.tensor([idx.numel()], dtype=torch.int32, device=idx.device)
        # count, then indices, then values: every view stays aligned to its element size
        return torch.cat([count.view(torch.uint8), p.tensors["indices"].view(torch.uint8),
                          p.tensors["values"].view(torch.uint8)])

    def from_wire(self, buf, shape, dtype, meta=None):
        buf = aligned(buf)
        isz = dtype.itemsize
        # a dry run's (meta) buffer holds no count: its size, count + entries, implies it
        m = (buf.numel() - 4) // (isz + 4) if buf.is_meta else int(buf[:4].view(torch.int32))
        if buf.numel() < 4 + m * (isz + 4):
            raise ValueError(f"{self.spec}: wire buffer of {buf.numel()} bytes is too short "
                             f"for its count {m}")
        idx = buf[4: 4 + 4 * m].view(torch.int32)
        values = buf[4 + 4 * m: 4 + m * (isz + 4)].view(dtype)
        return Payload({"indices": idx, "values": values}, torch.Size(shape), dtype, header_bytes=4)


class RandomK(Compressor):
    """~R*n entries at indices drawn from (seed, name, step), which every rank derives alike:
    only the values cross the wire. Draws k indices with replacement and keeps the distinct
    ones (about k(1 - R/2) of them): O(k) work instead of a permutation of all n.

    Bound: y_i is x_i exactly at the drawn indices, 0 elsewhere. NaN/Inf anywhere raise
    NonFiniteGradient (a ValueError): a random subset would drop them silently."""
    algorithm = "shared-index"

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio, self.seed = ratio, seed
        self.spec = f"randomk:{ratio:g}"
        self._steps = StepCounter()

    def indices(self, n: int, seed: int, device) -> torch.Tensor:
        k, _, _ = topk.target(n, self.ratio)
        # drawn by a CPU generator whatever the device: the same indices on every rank and
        # device type (CUDA's generator draws other numbers); k indices, ~R of the tensor
        g = torch.Generator(device="cpu").manual_seed(seed)
        if k * 4 >= n:  # dense draw: a permutation keeps exactly k
            idx = torch.randperm(n, generator=g, device="cpu")[:k].sort().values
        else:
            idx = torch.randint(n, (k,), generator=g, device="cpu").unique()
        return idx.to(device=device, dtype=torch.int32)

    def compress(self, x, name=""):
        check_float(x, self.spec)
        # a sum (2.2 ms on 16M) is finite iff... almost: only when it is not, look closer (59 ms)
        # (a dry run's meta tensors hold no values to check: taken as finite)
        if x.numel() and not x.is_meta and not math.isfinite(float(x.sum())) \
                and not torch.isfinite(x).all():
            raise NonFiniteGradient(f"{self.spec}: input has NaN/Inf values (gradient overflow?); "
                             "a random subset would drop them silently")
        seed = derive_seed(self.seed, name, self._steps.next(name))
        idx = self.indices(x.numel(), seed, x.device)
        values = x.reshape(-1)[idx.long()]
        return Payload({"values": values}, x.shape, x.dtype, meta={"seed": seed})

    def decompress(self, p, out=None):
        return _scatter(p, self.indices(p.numel, p.meta["seed"], p.tensors["values"].device), out)

    def layout(self, numel):
        return None  # the count of distinct indices depends on the seed

    def from_wire(self, buf, shape, dtype, meta=None):
        buf = aligned(buf)
        return Payload({"values": buf.view(dtype)}, torch.Size(shape), dtype, meta=dict(meta))

    def state_dict(self):
        return self._steps.state_dict()

    def load_state_dict(self, state):
        self._steps.load_state_dict(state)
