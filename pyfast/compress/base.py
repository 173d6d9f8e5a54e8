"""Payload (what crosses the wire) and the Compressor interface every spec implements."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pyfast.errors import NonFiniteGradient  # noqa: F401  (re-exported: pyfast.compress's)


@dataclass
class Payload:
    """A compressed tensor.

    `tensors` is exactly what crosses the wire; `header_bytes` counts the scalars that would
    travel with it (e.g. a top-k count). `meta` is what every rank already knows without
    sending it (shape, dtype, a shared seed), so it is not counted.
    """
    tensors: dict[str, torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    header_bytes: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device | None:
        """Where the payload's tensors are (None for a payload with no tensors)."""
        return next((t.device for t in self.tensors.values()), None)

    @property
    def nbytes(self) -> int:
        return self.header_bytes + sum(t.numel() * t.element_size() for t in self.tensors.values())


class Compressor:
    """compress(x, name) -> Payload; decompress(payload, out=None) -> tensor of x's shape and
    dtype (or `out`, filled with it).

    `name` identifies the tensor (a parameter or a bucket) across steps for compressors with
    per-tensor state (PowerSGD's warm start, the step counter behind a shared random seed).
    Ranks that call compress with the same names in the same order agree on that state.
    """
    spec = "?"

    # What the collectives need to know, declared by each compressor (pyfast.comm chooses from
    # these, never from the type; a new compressor is one file here plus its registry entry):
    # - algorithm: the all-reduce scheme it supports. "native" (nothing compressed: the
    #   backend's all-reduce); "dense" (a fixed-size payload per chunk: two-phase or
    #   allgather, decode_add sums); "sparse-allgather" (variable-size payloads gathered and
    #   summed with decode_add); "shared-index" (values at indices(n, seed, device) that every
    #   rank derives from the payload's meta["seed"]: the values are all-reduced);
    #   "powersgd" (the low-rank protocol: compressible, p_step, q_step, warm_start, q).
    # - block: elements coded together (1: each alone). A bucket starts every tensor at a
    #   multiple of it, and chunks of a collective start at multiples of `align`.
    # - per_tensor: reduce each parameter alone (a matrix to factor, a top-k selection), never a
    #   bucket of them.
    # - lossy: worth an error-feedback memory (wrap() adds one).
    # - deterministic: compress(x) depends on x alone (no random draw).
    # - native_kind: the C++ engine's name for this compressor (pyfast._C), or None.
    algorithm: str | None = None
    block = 1
    per_tensor = False
    lossy = True
    deterministic = True
    native_kind: str | None = None
    feedback = None  # the ErrorFeedback memory (WithFeedback), or None

    @property
    def base(self) -> "Compressor":
        """The compressor itself without error feedback (WithFeedback's inner one)."""
        return self

    @property
    def align(self) -> int:
        """Chunk starts inside a collective are multiples of this: the block, so that every block
        is coded whole, or 8 elements for elementwise formats (typed views stay aligned)."""
        return self.block if self.block > 1 else 8

    def wire_bytes(self, numel: int) -> int | None:
        """Bytes on the wire for `numel` elements, or None when the size depends on the data."""
        lay = self.layout(numel)
        return None if lay is None else sum(count * dt.itemsize for _, dt, count in lay)

    def decode_add(self, p: Payload, out: torch.Tensor) -> torch.Tensor:
        """out (contiguous fp32, p's numel) += decompress(p) in fp32; formats with a fused or
        sparse form override it."""
        return out.add_(self.decompress(p).reshape(out.shape).to(torch.float32))

    def compress(self, x: torch.Tensor, name: str = "") -> Payload:
        raise NotImplementedError

    def decompress(self, p: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor p encodes. With `out`, it is decoded into out (no new dense tensor where
        the format allows: a received chunk straight into its slice of a bucket) and out is
        returned; out must be p.dtype, on the payload's device, with p's number of elements
        (p.shape, or any shape with as many elements, filled in row-major order, e.g. a flat
        slice); it may be non-contiguous. Equal to decompress(p) bit for bit."""
        raise NotImplementedError

    def compress_with_feedback(self, x: torch.Tensor, ef: torch.Tensor, name: str = "",
                               out: torch.Tensor | None = None) -> Payload:
        """Compress x + ef and leave in ef what was not sent (ef is fp32, x's numel); with out
        (ef's shape), leave it in out instead and ef as it was.

        The generic form; compressors with a fused kernel override it. The residual is first
        rounded to x's dtype (what an uncompressed wire would carry) so that rounding, too,
        is remembered rather than lost.
        """
        r = x.reshape(-1).to(torch.float32) + ef
        p = self.compress(r.to(x.dtype).view(x.shape), name)
        torch.sub(r, self.decompress(p).reshape(-1).to(torch.float32),
                  out=ef if out is None else out)
        return p

    def layout(self, numel: int) -> list[tuple[str, torch.dtype, int]] | None:
        """(key, dtype, count) of each wire tensor for `numel` elements, or None when the
        size depends on the data (then the payload's header carries the counts)."""
        return None

    def to_wire(self, p: Payload) -> torch.Tensor:
        """The payload as one flat uint8 buffer of exactly p.nbytes bytes."""
        parts = [t.reshape(-1).view(torch.uint8) for t in p.tensors.values()]
        out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=p.device)
        assert out.numel() == p.nbytes, "payload header not serialized: override to_wire"
        return out

    def from_wire(self, buf: torch.Tensor, shape, dtype: torch.dtype, meta=None) -> Payload:
        lay = self.layout(math.prod(shape))
        if lay is None:
            raise NotImplementedError(f"{self.spec}: variable-size payloads override from_wire")
        sizes = [count * dt.itemsize for _, dt, count in lay]
        if sum(sizes) != buf.numel():
            raise ValueError(f"{self.spec}: wire buffer has {buf.numel()} bytes, the layout for "
                             f"{math.prod(shape)} elements needs {sum(sizes)}")
        buf = aligned(buf)
        tensors = {key: part.view(dt) for (key, dt, _), part in zip(lay, buf.split(sizes))}
        return Payload(tensors, torch.Size(shape), dtype, meta=dict(meta or {}))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{self.spec} keeps no state, got keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"pyfast.compress.get({self.spec!r})"


def check_out(p: Payload, out: torch.Tensor) -> None:
    """The contract of decompress(p, out): p's dtype and element count, the payload's device."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"decompress: out must be a tensor, got {type(out).__name__}")
    if out.dtype != p.dtype or out.numel() != p.numel:
        raise (TypeError if out.dtype != p.dtype else ValueError)(f"decompress: out must be {p.dtype} with {p.numel} elements (shape "
                         f"{tuple(p.shape)} or a view with as many), got {out.dtype} of shape "
                         f"{tuple(out.shape)}")
    dev = p.device or out.device
    if out.device != dev:
        raise ValueError(f"decompress: out is on {out.device} but the payload on {dev}")


def fill(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y (flat or shaped, p's elements) as the result: out filled with it, or y itself."""
    if out is None:
        return y
    return out.copy_(y.reshape(out.shape))


def flat(out: torch.Tensor) -> torch.Tensor | None:
    """out as a flat view to decode straight into, or None when it has no such view."""
    return out.view(-1) if out.is_contiguous() else None


def aligned(buf: torch.Tensor) -> torch.Tensor:
    """buf itself if its start is 8-byte aligned, else a copy: a slice of a received byte
    buffer may start anywhere, and typed views need their element alignment."""
    return buf if buf.storage_offset() % 8 == 0 else buf.clone()


def check_float(x: torch.Tensor, spec: str) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{spec}: gradients must be float32, bfloat16 or float16, got {x.dtype}")


class StepCounter:
    """Per-name call counts: the step part of a seed that every rank derives identically."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def next(self, name: str) -> int:
        s = self.steps.get(name, 0)
        self.steps[name] = s + 1
        return s

    def state_dict(self) -> dict:
        return {"steps": dict(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = {str(k): int(v) for k, v in state.get("steps", {}).items()}


def derive_seed(seed: int, name: str, step: int) -> int:
    """A 63-bit seed from (seed, name, step), the same on every rank and every run."""
    h = seed & 0xFFFFFFFF
    for ch in f"{name}\0{step}".encode():
        h = (h * 0x100000001B3 ^ ch) & 0x7FFFFFFFFFFFFFFF  # FNV-style: stable, unlike hash()
    return h
