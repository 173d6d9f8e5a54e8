"""Gradient buckets: launch each bucket's reduction the moment its last gradient is ready.

Parameters go into buckets of about `bucket_mb` (the first one FIRST_BUCKET_MB) in reverse
registration order (backward produces gradients roughly in that order, as DDP assumes).
Buckets are launched strictly in index order, so every rank issues the same collectives in
the same order even when backward finishes gradients in a slightly different order. The wait
is queued as an autograd final callback: when loss.backward() returns, every gradient is
reduced (as in DDP).

Each parameter starts at a multiple of `align` elements (the compressor's quantization block),
the gap being zeros, so a block never holds two parameters: a parameter's compression error is
then the one it has when compressed alone. Measured before this rule on a tiny HF Llama (hidden
64: 64-element norm weights shift every later offset), int8: q_proj/k_proj came back with 15-29%
relative error against 0.8% alone, a block's scale being set by its larger neighbour. Cost: under
`align` - 1 elements per parameter (int8's 512: 0.4% of gpt-small's 10.8M, 104 tensors).

Buckets are fp32 whatever the gradients' dtype (bf16 and fp16 gradients are widened exactly and
the reduced average is rounded once, back into their dtype) and live on the parameters' device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_params(named, who: str) -> None:
    """The parameters a flat fp32 buffer can serve: float32, bfloat16 or float16 (widened
    exactly; fp64 and complex would be rounded silently), all on one device. `who` names the
    wrapper in the error (DataParallel, zero)."""
    for n, p in named:
        if p.dtype not in FLOATS:
            raise TypeError(f"{who} reduces float32, bfloat16 and float16 parameters; {n!r} is "
                            f"{p.dtype} (never rounded silently: keep it out of the wrapped "
                            "module, freeze it, or convert it)")
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"{who} needs every parameter on one device, got "
                         f"{sorted(map(str, devices))}")


@dataclass
class Bucket:
    index: int
    params: list
    names: list
    offsets: list
    flat: torch.Tensor
    pending: int = 0
    ready: bool = False
    handle: object = None
    extra: dict = field(default_factory=dict)
    gaps: list = field(default_factory=list)  # [start, end) of the zero padding between params

    @property
    def name(self) -> str:
        return f"bucket{self.index}"


# The first bucket is capped at 1 MB (as DDP's _DEFAULT_FIRST_BUCKET_BYTES) so the link starts
# working right after the last layer's backward; see DataParallel's bucket_mb for the rest.
FIRST_BUCKET_MB = 1.0


class Bucketer:
    def __init__(self, named_params, bucket_mb: float, launch, enabled: bool = True,
                 first_mb: float | None = None, align: int = 1):
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.launch_fn, self.enabled, self.align = launch, enabled, align
        self.buckets: list[Bucket] = []
        first = min(FIRST_BUCKET_MB if first_mb is None else first_mb, bucket_mb)
        members: list = []
        size = 0
        for name, p in reversed(list(named_params)):
            members.append((name, p))
            size += -(-p.numel() // align) * align * 4  # reduced in fp32
            if size >= (first if not self.buckets else bucket_mb) * 2 ** 20:
                self._add(members)
                members, size = [], 0
        if members:
            self._add(members)
        self.where = {}
        self._hooks = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self.where[p] = (b, i)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
        self.armed = False
        self.on_finish = None
        self._next = 0
        self._queued = False

    def _add(self, members) -> None:
        offsets, gaps, off = [], [], 0
        for _, p in members:
            offsets.append(off)
            end = off + p.numel()
            off = -(-end // self.align) * self.align
            if off > end:
                gaps.append((end, off))
        if gaps and gaps[-1][1] == off:  # no padding after the last parameter
            off = gaps.pop()[0]
        dev = members[0][1].device
        self.buckets.append(Bucket(len(self.buckets), [p for _, p in members],
                                   [n for n, _ in members], offsets,
                                   torch.zeros(off, dtype=torch.float32, device=dev), gaps=gaps))

    def arm(self, on_finish) -> None:
        """Reduce the gradients of the next backward (called by forward)."""
        self.armed, self.on_finish, self._next, self._queued = True, on_finish, 0, False
        for b in self.buckets:
            b.pending, b.ready, b.handle = len(b.params), False, None

    def disarm(self) -> None:
        self.armed = False

    def close(self) -> None:
        """Remove the gradient hooks: the parameters no longer reference this bucketer."""
        self.armed = False
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._final)
            self._queued = True
        b, _ = self.where[p]
        b.pending -= 1
        if b.pending == 0:
            b.ready = True
            if self.enabled:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        with torch.no_grad():
            for a, e in b.gaps:  # the reduction wrote decoded values here (sign: +-scale)
                b.flat[a:e].zero_()
            for p, off in zip(b.params, b.offsets):
                dst = b.flat[off: off + p.numel()]
                if p.grad is None:  # unused this step: contributes zeros, as in DDP
                    dst.zero_()
                else:
                    dst.copy_(p.grad.reshape(-1))
        self.launch_fn(b)

    def flush(self) -> None:
        """Launch every bucket now (all gradients taken as they are) and wait: for gradients
        accumulated outside an armed backward."""
        self._final()

    def _final(self) -> None:
        """Autograd final callback: launch what is left (unused parameters), then wait."""
        self.armed = False
        for b in self.buckets:
            b.ready = True
        self._launch_ready()
        self.finish_and_callback()

    def finish(self, keep=None, before=None) -> list[Bucket]:
        """Wait for every launched bucket, call before(buckets), then copy the reduced values
        into the gradients. keep(bucket, i) False: the i-th parameter's .grad is left as it is
        (None when no rank produced one)."""
        # Wait for every launched bucket even after one failed: a reduction still running on
        # the communication thread would otherwise interleave with the caller's next
        # collective, in a different order on each rank (seen as a 120 s gloo hang in tests).
        errors = []
        for b in self.buckets:
            if b.handle is not None:
                try:
                    b.handle.wait()
                except BaseException as e:
                    errors.append(e)
                    b.extra["failed"] = True
        if errors:
            for b in self.buckets:
                b.handle = None
            raise errors[0]
        if before is not None:
            before(self.buckets)
        done = []
        for b in self.buckets:
            if b.handle is None:
                continue
            b.extra["seconds"] = getattr(b.handle, "seconds", float("nan"))
            b.handle = None
            with torch.no_grad():
                for i, (p, off) in enumerate(zip(b.params, b.offsets)):
                    if keep is not None and not keep(b, i):
                        continue
                    src = b.flat[off: off + p.numel()].view(p.shape)
                    if p.grad is None:
                        p.grad = src.to(p.dtype).clone()
                    else:
                        p.grad.copy_(src)
            done.append(b)
        return done

    def finish_and_callback(self) -> None:
        if self.on_finish is not None:
            self.on_finish()
        else:
            self.finish()
