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

Gradients as bucket views (views=True: DataParallel's gradient_as_bucket_view, DDP's flag): after
a reduction an fp32 parameter's .grad is its piece of the bucket, so the result is not copied
out; a backward that accumulates into it (zero_grad(set_to_none=False), no_sync, no zero_grad)
writes the bucket directly, so it is not copied in either. zero_grad() (set_to_none=True,
torch's default) gives autograd a fresh tensor: that one is copied in. As with DDP's flag, a
reference to .grad kept across steps sees the next reduction (clone it to keep it), and the
gradients and the buckets are one memory (4 bytes a parameter less between steps). 16-bit
parameters get a gradient of their dtype, copied out. The copies are one torch._foreach_copy_ a
bucket each way, not one Python call a parameter. A memory option, not a speed one, on the CPU:
`pyfast bench dp --cpu-split` (gpt-small, 2 ranks x 1 thread, this 2-core EPYC, loaded) has copy
in 2.9-3.3 ms and copy out 2.9-4.0 ms a rank-step without views, 0.7 and 0.2 ms with views and
zero_grad(set_to_none=False), but the step's unattributed main-thread time grows by more (+10 to
+37 ms over three runs, either zero_grad; not pinned down: autograd's in-place accumulation,
zero_grad's zeroing and the page faults of gradients freed mid-step were not measured apart).

Also here, for every bucketed reducer (DataParallel, ZeRO): the parameter checks at
construction, the replicas' start (rank 0's state broadcast, the layouts agreed), the default
bucket size and the engine choices. Readiness and the side band: pyfast.comm.ready.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pyfast.comm.agree import agree
from pyfast.comm.ready import Readiness, wait_then_raise


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


ENGINES = ("auto", "native", "python")
# 4 MB buckets (the first 1 MB, FIRST_BUCKET_MB), not DDP's 25: the engine pipelines
# pieces inside a bucket, so a bucket only has to be big enough to hide a job's fixed cost, and
# small buckets start the link early. `pyfast bench dp`'s MLP (9.4M parameters), int8, native
# engine, 2 ranks on this 2-core EPYC at 1 Gbit/s, medians of 10 steps, two rounds: 25 MB
# (2 buckets, the first ready 3/4 into backward) 237-245 ms; DDP's 1 MB first + 25 MB 234-237;
# 4 MB (one bucket per layer) 203-210 (comm alone 150-155, compute alone 80). Job cost: 9.4M
# elements as 16 int8 jobs of 2.25 MB take the time of one job (37 vs 48 ms on loopback, 151
# vs 165 ms at 1 Gbit/s); 256 jobs of 0.14 MB took 199 ms on loopback.
BUCKET_MB = 4.0
# Compressor "none": DDP's 25 MB. Nothing is encoded or pipelined inside such a bucket, so a
# smaller one only adds a collective's fixed cost (Python launch, NCCL or gloo launch). On the
# lent H200 (gpt-small, NCCL world of one, tools/gpu_dp_vs_ddp.py, medians of 7) 25 MB buckets ran
# 1.6-2.6 ms a step faster than 4 MB (3 collectives against 11) out of 20-23 ms. On this 2-core
# EPYC (`pyfast bench dp --configs ddp,pyfast:none`, 9.4M-parameter MLP, 2 ranks, 10 steps):
# loopback 106 ms a step with 25 MB against 110 with 4 MB (DDP 112-114); at 1 Gbit/s 648 and 648
# (the link bound: 605 ms of it): the finer buckets bought nothing there.
NONE_BUCKET_MB = 25.0


def default_bucket_mb(spec: str) -> float:
    """DataParallel's bucket size when the caller gives none (BUCKET_MB, NONE_BUCKET_MB)."""
    return NONE_BUCKET_MB if spec == "none" else BUCKET_MB


def check_same_layout(params: list[tuple[str, torch.Tensor]], group=None) -> None:
    """Raise on every rank, naming ranks and tensor, if parameter names/shapes/dtypes differ
    (instead of hanging in a collective of mismatched sizes). comm.agree: one small all_gather."""
    lines = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in params]

    def differ(every: list) -> str:
        bad = next(r for r, x in enumerate(every) if x != every[0])
        a, b, n = every[0], every[bad], max(len(every[0]), len(every[bad]))
        a, b = a + [None] * (n - len(a)), b + [None] * (n - len(b))  # one may be the other's prefix
        first = next(i for i in range(n) if a[i] != b[i])
        return (f"parameters differ across ranks: rank 0 has {len(every[0])} tensors, rank {bad} "
                f"has {len(every[bad])}; first difference at #{first}: rank 0 {a[first]!r} vs "
                f"rank {bad} {b[first]!r}")
    agree(lines, None, group, device=params[0][1].device if params else None, differ=differ)


def broadcast_state(module: torch.nn.Module, group=None) -> None:
    broadcast_coalesced(list(module.parameters()) + list(module.buffers()), group)


# DDP's broadcast_bucket_size: tensors are flattened into broadcasts of at most this size
BROADCAST_BYTES = 250 * 2 ** 20


def broadcast_coalesced(tensors: list[torch.Tensor], group=None) -> None:
    """Group rank 0's values into every rank's tensors, coalesced by (device, dtype): torch's
    own C++ routine, the one DDP broadcasts its buffers with at every forward (measured on
    gpt-small's 12 rotary buffers, this 2-core EPYC: 0.25 ms a call against 0.8 for the same
    work in Python), Python's where torch lacks it or a tensor is not contiguous."""
    if hasattr(dist, "_broadcast_coalesced") and all(t.is_contiguous() for t in tensors):
        pg = group if group is not None else dist.group.WORLD
        with torch.no_grad():
            dist._broadcast_coalesced(pg, tensors, BROADCAST_BYTES, 0)
        return
    kinds: dict = {}
    for t in tensors:
        kinds.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for ts in kinds.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, group=group, group_src=0)
            for t, part in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(part.view(t.shape))


@dataclass
class Bucket:
    index: int
    params: list
    names: list
    offsets: list
    flat: torch.Tensor
    handle: object = None
    extra: dict = field(default_factory=dict)
    gaps: list = field(default_factory=list)  # [start, end) of the zero padding between params
    views: list = field(default_factory=list)  # each parameter's piece of flat, in its shape
    holes: list = field(default_factory=list)  # flat's views of the gaps
    scale: float | None = None  # gradients multiplied by it on their way in (else the bucketer's)

    def __post_init__(self):
        self.views = [self.flat[o:o + p.numel()].view(p.shape)
                      for p, o in zip(self.params, self.offsets)]
        self.holes = [self.flat[a:e] for a, e in self.gaps]

    @property
    def name(self) -> str:
        return f"bucket{self.index}"


# The first bucket is capped at 1 MB (as DDP's _DEFAULT_FIRST_BUCKET_BYTES) so the link starts
# working right after the last layer's backward; see BUCKET_MB for the rest.
FIRST_BUCKET_MB = 1.0


class Bucketer:
    """DataParallel's buckets (module docstring), launched by a comm.ready.Readiness:
    launch(bucket) is called with the bucket's gradients copied in, in bucket order."""

    def __init__(self, named_params, bucket_mb: float, launch, enabled: bool = True,
                 first_mb: float | None = None, align: int = 1, views: bool = False):
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.launch_fn, self.align, self.views = launch, align, views
        self.scale: float | None = None  # gradients multiplied by it on their way in
        # weight(scale) -> the factor actually used (a rank's sample weight times scale:
        # comm.weights); None: scale as it is
        self.weight = None
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
        self.ready = Readiness([b.params for b in self.buckets], self._launch, self._final,
                               enabled)
        self.on_finish = None

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

    @property
    def armed(self) -> bool:
        return self.ready.armed

    def arm(self, on_finish) -> None:
        """Reduce the gradients of the next backward (called by forward)."""
        self.on_finish = on_finish
        for b in self.buckets:
            b.handle = None
        self.ready.arm()

    def disarm(self) -> None:
        self.ready.disarm()

    def close(self) -> None:
        """Remove the gradient hooks: the parameters no longer reference this bucketer."""
        self.ready.close()

    def _launch(self, i: int) -> None:
        """Bucket i's gradients into its buffer (times `scale`, if set), then launch_fn: one
        foreach copy (a Python call a bucket, not one a parameter), nothing for a gradient that
        is already its view."""
        b = self.buckets[i]
        unused, dst, src, inplace = [], [], [], []
        for p, v in zip(b.params, b.views):
            g = p.grad
            if g is None:  # unused this step: contributes zeros, as in DDP
                unused.append(v)
            elif g is v:
                inplace.append(v)
            else:
                dst.append(v)
                src.append(g)
        with torch.no_grad():
            if b.holes:  # the reduction wrote decoded values here (sign: +-scale)
                torch._foreach_zero_(b.holes)
            if unused:
                torch._foreach_zero_(unused)
            scale = self.scale if b.scale is None else b.scale
            if self.weight is not None:
                scale = self.weight(scale)
            if scale is None:
                if dst:
                    torch._foreach_copy_(dst, src)
            else:
                self._scaled_copy(dst, src, inplace, scale)
        self.launch_fn(b)

    @staticmethod
    def _scaled_copy(dst, src, inplace, scale) -> None:
        """dst = src * scale in one pass (DDP's copy-in divides the same way): torch has no
        foreach op with an output, so one call a parameter (~3 us each) to save the pass over
        the bucket that a division after the reduction costs (43 MB on gpt-small)."""
        for v, g in zip(dst, src):
            if g.dtype == v.dtype:
                torch.mul(g, scale, out=v)
            else:  # widened first: 16-bit arithmetic would round the product
                v.copy_(g).mul_(scale)
        if inplace:
            torch._foreach_mul_(inplace, scale)

    def flush(self) -> None:
        """Launch every bucket now (all gradients taken as they are) and wait: for gradients
        accumulated outside an armed backward."""
        self.ready.flush()

    def _final(self) -> None:
        if self.on_finish is not None:
            self.on_finish()
        else:
            self.finish()

    def finish(self, keep=None, before=None, early: bool = False) -> list[Bucket]:
        """Wait for every launched bucket (comm.ready.wait_then_raise), call before(buckets),
        then copy the reduced values into the gradients. keep(bucket, i) False: the i-th
        parameter's .grad is left as it is (None when no rank produced one).

        early=True (for a `before` that changes no bucket: it runs after the copies): each
        bucket is copied out as soon as its own reduction is done, in order, while the later
        ones are still on the wire, as DDP's finalize does (gpt-small: 31 of its 43 MB copied
        while the last bucket is reduced). A failure still waits for every bucket first."""
        if not early:
            try:
                wait_then_raise([b.handle for b in self.buckets])
            except BaseException:
                for b in self.buckets:
                    b.handle = None
                raise
            if before is not None:
                before(self.buckets)
        done = []
        try:
            for b in self.buckets:
                if b.handle is None:
                    continue
                b.handle.wait()  # done already unless early
                b.extra["seconds"] = getattr(b.handle, "seconds", float("nan"))
                b.handle = None
                self._copy_out(b, keep)
                done.append(b)
        except BaseException:  # early only: the rest still run; wait for them, then raise
            with contextlib.suppress(BaseException):
                wait_then_raise([b.handle for b in self.buckets])
            for b in self.buckets:
                b.handle = None
            raise
        if early and before is not None:
            before(self.buckets)
        return done

    def _copy_out(self, b: Bucket, keep) -> None:
        dst, src = [], []
        for i, (p, v) in enumerate(zip(b.params, b.views)):
            if (keep is not None and not keep(b, i)) or p.grad is v:
                continue
            if self.views and p.dtype == v.dtype and p.is_contiguous():
                p.grad = v  # the gradient is the bucket's view: no copy (module docstring)
            elif p.grad is None:
                p.grad = v.to(p.dtype).clone()
            else:
                dst.append(p.grad)
                src.append(v)
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
