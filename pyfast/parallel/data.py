"""Data parallelism: DataParallel, a drop-in for torch's DistributedDataParallel that reduces
gradients through a compressor, bucket by bucket, while backward is still running.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time

import torch
import torch.distributed as dist
from torch import nn

import pyfast.compress as C
from pyfast._ranges import ranged
from pyfast.comm import all_reduce
from pyfast.comm.engine import NativeEngine, status as native_status
from pyfast.comm.collectives import all_finite, all_reduce_pieces, sum_async
from pyfast.comm.auto import CANDIDATES as AUTO_CANDIDATES, AutoSelector
from pyfast.comm.buckets import (BUCKET_MB, ENGINES, Bucketer, broadcast_coalesced,  # noqa: F401
                                 broadcast_state, check_params, check_same_layout,
                                 default_bucket_mb)
from pyfast.comm.failure import Breaker, new_group_like
from pyfast.comm.guard import FiniteGuard
from pyfast.comm.ready import ParamWatch, SideBand
from pyfast.comm.weights import SampleWeights
from pyfast.parallel import ft_reduce
from pyfast.parallel.samples import Samples, refuse_torchft

log = logging.getLogger(__name__)


class DataParallel(Samples, nn.Module):
    """DistributedDataParallel's job with a compressor, and DDP's semantics:

    - A parameter no rank produced a gradient for this step keeps `.grad is None` (DDP with
      find_unused_parameters=True); one used on some ranks only is averaged with zeros from the
      others. No flag is needed: which parameters each rank used travels in a side band, one
      exact fp32 all-reduce of (parameters + buckets) elements queued after the last bucket
      (what it costs: bench/results/dp_semantics.txt).
    - Parameters with requires_grad=False are not reduced and keep `.grad is None`; freezing or
      adding a parameter after wrapping raises at the next forward (re-wrap instead).
    - broadcast_buffers=True (the default, as DDP): at every forward with autograd on (outside
      no_sync), group rank 0's buffers are broadcast to the others, one broadcast per dtype. As
      in DDP, a forward then updates each rank's buffers from its own batch: call
      sync_buffers() (or run a last forward in eval mode) for equal buffers after training.
    - check_finite ("skip" by default: a GradScaler then works unchanged, as with DDP): a rank
      whose bucket holds NaN/Inf sends zeros without touching its error-feedback memory; if any
      rank had one, every rank gets NaN in that bucket (GradScaler skips the same step
      everywhere) and every feedback memory and compressor state is put back as before the
      step (the memory is double-buffered for the step: nothing is copied). A block
      quantizer (int8, int4, fp8, sign) carries a NaN/Inf block to every rank as NaN, so its
      buckets are checked after the reduction, one element a block, not before compressing
      (the rank with the NaN sends it; its memory is dropped with the step's). With
      compressor none, fp16 or bf16 (nothing to put back) no check runs: NaN/Inf
      cross the reduction as they are and reach every rank in the same elements, with the
      same effect on GradScaler; `skipped` is then computed when read. "raise":
      NonFiniteGradient on every rank instead. False: no check (NaN/Inf go through the
      compressor as they are). See pyfast.comm.guard for the costs.
    - Buckets are fp32 whatever the parameters' dtype (bf16 / fp16 gradients are widened
      exactly; the average is rounded once into their dtype: more exact than DDP, whose buckets
      take the gradients' dtype); fp64 or complex parameters raise at construction. Shared
      (tied) parameters are reduced once. Each parameter starts on a compressor block boundary
      (pyfast.comm.buckets), and top-k / PowerSGD reduce each parameter alone: a parameter's
      compression error never depends on its neighbours.
    - A failed collective (dead peer, timeout) raises CommError naming the operation; the
      module is then broken and every later forward raises. Under torchft (`replicas`) it is
      reported to torchft instead: this group's step does not commit and the module stays
      usable. `timeout=` (seconds or timedelta) runs the reductions on a private group with
      that timeout (collective, like dist.new_group); without it the group's own applies.

    - gradient_as_bucket_view=True (DDP's flag, off by default as in DDP): an fp32 parameter's
      .grad is its piece of the bucket after a reduction: no copy out of the bucket, and none
      into it when backward accumulates into an existing .grad (zero_grad(set_to_none=False),
      no_sync); one memory for gradients and buckets. A .grad kept across steps then sees the
      next reduction, as with DDP (pyfast.comm.buckets; its cost: `pyfast bench dp
      --cpu-split`).

    state_dict() keys are the wrapped module's with a "module." prefix, exactly as DDP's, so
    checkpoints move between the two. The compression state (error-feedback memory per
    bucket, compressor state such as PowerSGD's Q or shared-seed step counters) is not a
    module state: save it with compression_state_dict() and restore it with
    load_compression_state_dict() (DDP's comm hooks have no equivalent).

    bucket_mb: the gradient buckets' size in MB (fp32; the first bucket 1 MB, as DDP's).
    None: DDP's 25 for compressor none, whose buckets are the backend's plain all-reduce (fewer
    collectives, less fixed cost a step), 4 for the others, whose buckets are encoded in pieces
    that pipeline with the transfer (pyfast.comm.buckets says what decided both).

    engine: who reduces the buckets while backward runs. "native": the C++ overlap engine
    (pyfast.comm.engine), no Python and no GIL on the communication path; dense deterministic
    compressors only (none, fp16, bf16, int8, int4, fp8, sign, and compressor="auto", whose
    candidates are those), else ValueError. "python": pyfast.comm.all_reduce on its Python
    thread (every compressor). "auto": native where it can run (the compressor, and the
    parameters' device: CPU, or CUDA with a CUDA build of pyfast._C), python otherwise;
    `engine` says which it chose (logged once at INFO), `engine_kind[i]` which one reduces
    bucket i. Both give bitwise-identical results and
    keep the error-feedback memory under the same names (checkpoints move between them).
    Compressor "none" (and "auto" once settled on none everywhere) has nothing to encode: its
    buckets and the side band go straight to the backend's own async all-reduce from
    backward's hooks, whichever engine, as DDP issues them (comm.collectives.sum_async), and
    each bucket is copied out once reduced while later ones are still on the wire.

    The native engine runs on a process group of its own (pyfast.comm.engine.private_group):
    construction is then collective over the default group, like dist.new_group. Call close()
    before dist.destroy_process_group(): it joins the engine's thread and destroys its group
    (`del` is not enough: the gradient hooks on the wrapped module's parameters keep this object
    alive as long as the module lives).

    replicas: a pyfast.parallel.ft.Replicas (torchft): `group` is then this replica group's
    own dp group, and every bucket is averaged over the participating replica groups too (an
    exact sum inside the group, then the compressor across groups; pyfast.parallel.ft_reduce),
    divided by the participants of the step. Per step: replicas.start(), forward/backward,
    `if replicas.commit(): optimizer.step()`. The error-feedback memory and compressor state
    advance only when the step commits; a healing group receives the compressor state and
    starts with an empty memory (ft_reduce says why). engine "python" only
    ("auto" picks it; "native" and compressor="auto" raise FTError).

    samples (an int, or per step `model.samples = n` before the forward): this rank's samples
    this step, for ranks with different batch sizes (docs/hetero.md). Each rank's loss stays
    a mean over its own n samples; its gradient is weighted n / sum(n) in the reduction, so
    the result is the gradient of the concatenated batch, with every compressor, engine and
    error feedback (whose memory then holds weighted residuals: pyfast.comm.weights). sum(n)
    travels in one all-reduce of W floats started at the forward that arms the reduction (or
    in reduce_gradients()); a rank with n < 1 makes every rank raise ValueError after the
    step's reductions. None (the default): the plain mean, bit-identical to no weighting.
    None or an int on every rank alike (it decides a collective). Not under torchft
    (FTError: the divisor there is the step's participants, known after the quorum).
    """

    # Benchmark only (pyfast.benchmarks.dp_semantics): skip the DDP-semantics work (the side
    # band of used flags, the parameter check and the buffer broadcast) to measure its cost.
    # Unused parameters then get zeros and NaN flags are not exchanged: never set in training.
    _bare = False

    def __init__(self, module: nn.Module, compressor=None, bucket_mb: float | None = None,
                 group=None, error_feedback: bool = True, overlap: bool = True, check_finite="skip",
                 engine: str = "auto", broadcast_buffers: bool = True, timeout=None,
                 gradient_as_bucket_view: bool = False, replicas=None, samples=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed initialized "
                               "(torchrun + dist.init_process_group)")
        if bucket_mb is not None and bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.module, self.group, self.overlap = module, group, overlap
        self.broadcast_buffers = broadcast_buffers
        self.world = dist.get_world_size(group)
        self.auto = compressor == "auto"
        if replicas is not None:
            engine = ft_reduce.check(engine, self.auto)
            refuse_torchft("DataParallel", samples)
        base = C.get("fp16" if self.auto else compressor)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        dev = named[0][1].device if named else None  # the error-feedback memory's, loads too
        self.compressor = C.wrap(base, error_feedback, dev)
        check_params(named, "DataParallel")
        self._guard = FiniteGuard(check_finite, self._compressors)
        self.check_finite = self._guard.mode
        native = self._native(engine, dev)  # before any collective or hook: a refusal leaves no trace
        # the group every reduction runs on: the caller's, or a private one with `timeout`
        self._comm = new_group_like(group, timeout) if timeout is not None else group
        check_same_layout(named, self._comm)
        broadcast_state(module, self._comm)
        usable = [C.get(s) for s in AUTO_CANDIDATES] if self.auto else [self.compressor]
        align = math.lcm(*(c.block for c in usable))
        # auto settled on "none" everywhere, at the default size: none's buckets (_rebucket)
        self._regroup, self._settled = self.auto and bucket_mb is None, None
        if bucket_mb is None:  # 4 MB; DDP's 25 for compressor none (comm.buckets)
            bucket_mb = default_bucket_mb("auto" if self.auto else base.spec)
        self.bucketer = Bucketer(named, bucket_mb, self._launch, enabled=overlap, align=align,
                                 views=gradient_as_bucket_view)
        self.selector = (AutoSelector(self.bucketer.buckets, self._comm, error_feedback)
                         if self.auto else None)
        # NaN/Inf left to the sum (comm.guard); auto may pick a lossy compressor any step
        self._through = not self.auto and self._guard.passes_through()
        # The backend's own all-reduce (compressor "none"): the average is taken on the way into
        # the bucket, as DDP's copy-in does, so the reduction sums and nothing divides after it
        # (a pass over every bucket: 2-3 ms of the engine thread's CPU a step on gpt-small).
        # x / W summed equals the sum / W bit for bit when W is a power of two (no underflow).
        # (not under torchft: the divisor is the step's participants, known after the quorum)
        self._sum = (not self.auto and self.compressor.algorithm == "native" and self.world > 1
                     and replicas is None)
        if self._sum:
            self.bucketer.scale = 1.0 / self.world
        # ... and each bucket goes straight to the backend, issued from backward's hook as DDP
        # issues it (collectives.sum_async), not through the engine's FIFO: gloo then runs two
        # buckets at once. gpt-small, 2 ranks on loopback: backward's end to its return 43 ms
        # through the engine, 32.5 with DDP (issue 32)
        self._direct = self._sum
        # Per bucket, so that a per-bucket compressor could mix the two; uniform today (auto's
        # candidates are all dense).
        self.engine = "native" if native else "python"  # what engine="auto" chose
        self.engine_kind = [self.engine] * len(self.bucketer.buckets)
        self._engine = NativeEngine.private(group, timeout) if native else None
        self._named, self._params = named, [p for _, p in named]
        self._watch = ParamWatch(module, named, "DataParallel was built")
        # used flags per parameter, then one non-finite flag per bucket
        buckets = self.bucketer.buckets
        self._band = SideBand([len(b.params) for b in buckets], len(buckets), dev)
        self._breaker = Breaker("this DataParallel")
        self._sync, self._closed = True, False
        self._wait = 0.0  # last_wait_s
        self._skipped = False  # None: the last reduction's verdict is read on demand
        self._ft = None if replicas is None else ft_reduce.ReplicaReduce(
            replicas, self._guard, self._comm,
            (lambda: ft_reduce.without_memory(self.compression_state_dict()),
             self.load_compression_state_dict))
        self._weights = SampleWeights("DataParallel", self.world, dist.get_rank(group), dev)
        self.bucketer.weight = self._weight
        self.samples = samples  # pyfast.parallel.samples

    def _torchft(self) -> bool:
        return self._ft is not None

    def _issue(self, vec):
        """Sum the samples vector over the group on the path the buckets take (after them in
        every FIFO, so the ranks pair their collectives alike)."""
        if self._direct:
            return sum_async(vec, self._comm, "samples")
        if self._engine is not None:
            return self._engine.all_reduce(vec, None, op="sum", name="samples")
        return all_reduce(vec, None, self._comm, op="sum", async_op=True, name="samples")

    @property
    def _reducing(self):
        """The group the buckets are reduced on: the quorum's under torchft."""
        return self._comm if self._ft is None else self._ft.group

    def _compressors(self) -> list:
        if self._settled is not None:
            return [self._settled]
        return list(self.selector.made.values()) if self.selector else [self.compressor]

    def _pick(self, bucket):
        """The compressor that reduces `bucket` this step."""
        if self._settled is not None:
            return self._settled
        return self.selector.compressor(bucket) if self.selector else self.compressor

    def _native(self, engine: str, device) -> bool:
        """Whether the native engine reduces the buckets; ValueError if it was asked for and
        cannot (no silent fallback). device: the parameters' (the engine runs CPU tensors, and
        CUDA ones only in a CUDA build of pyfast._C)."""
        usable = [C.get(s) for s in AUTO_CANDIDATES] if self.auto else [self.compressor]
        ok, why = native_status(device)
        unsupported = [c.spec for c in usable if not NativeEngine.supports(c)]
        if engine == "native" and not ok:
            raise ValueError(f"engine='native' cannot run: {why}; use engine='python' or 'auto'")
        if engine == "native" and unsupported:
            raise ValueError(f"engine='native' does not run {', '.join(unsupported)} (dense "
                             "deterministic compressors only: none, fp16, bf16, int8, int4, fp8, "
                             "sign); use engine='python' or 'auto'")
        native = engine != "python" and ok and not unsupported
        if engine == "auto":  # once per DataParallel: which engine "auto" chose, and why
            why = why or (f"the engine does not run {', '.join(unsupported)}" if unsupported else "")
            log.info("DataParallel(engine='auto') on %s: %s%s", device,
                     "native" if native else "python", f" ({why})" if why and not native else "")
        return native

    # ------------------------------------------------------------------ reduction
    @ranged("pyfast.dp.launch")
    def _launch(self, bucket) -> None:
        """Called by the bucketer when a bucket's gradients are all ready (in bucket order)."""
        if bucket.index == 0:
            self._guard.begin()
            self._band.begin()
        if not self._bare:
            self._band.mark_used(bucket.index, bucket.params)
        c = self._pick(bucket)
        # a block quantizer carries NaN/Inf through to every rank: checked after (comm.guard)
        fold = bucket.extra["fold"] = not self._through and self._guard.folds(c)
        ok = self._through or fold or self._guard.local_ok(bucket.flat)
        if not ok:  # NaN/Inf here: send zeros, flag it, keep the feedback memory out of it
            bucket.flat.zero_()
            self._band.set_extra(bucket.index)
        bucket.extra["c"] = c
        summed = self._sum or bucket.scale is not None  # averaged on its way in
        bucket.handle = self.reduce_async(bucket, self._guard.for_bucket(c, bucket.name, ok),
                                          "sum" if summed else "avg")

    def reduce_async(self, bucket, c=None, op: str = "avg"):
        """Start averaging (op="sum": summing) bucket.flat over the group with compressor c
        (default: this DataParallel's); returns a handle with wait() and `seconds` (what
        compressor="auto" measures)."""
        if c is None:
            c = self._pick(bucket)
        if self._ft is not None:  # averaged over the replica groups too (parallel.ft_reduce)
            return self._ft.reduce_async(bucket, c, c.per_tensor)
        if self._direct and op == "sum" and c.algorithm == "native":
            return sum_async(bucket.flat, self._comm, bucket.name)
        if self.engine_kind[bucket.index] == "native":
            return self._engine.all_reduce(bucket.flat, c, op=op, name=bucket.name)
        if c.per_tensor:  # a matrix to factor, a selection: each parameter alone
            pieces = [(n, o, p.shape)
                      for p, n, o in zip(bucket.params, bucket.names, bucket.offsets)]
            return all_reduce_pieces(bucket.flat, pieces, c, self._comm, op=op,
                                     name=bucket.name)
        return all_reduce(bucket.flat, c, self._comm, op=op, async_op=True, name=bucket.name)

    def close(self) -> None:
        """Wait for reductions in flight, remove the gradient hooks, join the native engine's
        thread and destroy its process group. Call it before dist.destroy_process_group.
        Idempotent; the wrapped module is left as it is (usable without DataParallel)."""
        self._closed = True
        with contextlib.suppress(BaseException):  # a samples vector still in flight
            self._weights.drop()
        for b in self.bucketer.buckets:
            if b.handle is not None:
                with contextlib.suppress(BaseException):  # already raised, or will not matter
                    b.handle.wait()
                b.handle = None
        self.bucketer.close()
        self._watch.close()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._comm is not self.group:
            with contextlib.suppress(BaseException):  # the peers may be gone
                dist.destroy_process_group(self._comm)
            self._comm = self.group

    @ranged("pyfast.dp.wait")
    def _finish(self) -> None:
        # exposed communication: what the training thread spent waiting for the buckets (and
        # copying them back) after backward's last gradient. On CUDA, two events on the stream
        # (from the end of backward's kernels to the end of the reductions' copy back), read
        # when last_wait_s is: timing it with host clocks cost two host syncs a step, which
        # stop the CPU from queueing the next step's kernels (issue 25, measured on the H200)
        dev = self._params[0].device if self._params else None
        cuda = dev is not None and dev.type == "cuda"
        t0 = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            t0.record()
        try:
            done = []
            with (self._ft.reported() if self._ft is not None
                  else self._breaker.guard("DataParallel gradient reduction")):
                done = self._reduce_and_copy()
        finally:
            if cuda:
                t1 = torch.cuda.Event(enable_timing=True)
                t1.record()
                self._wait = (t0, t1)
            else:
                self._wait = time.perf_counter() - t0
        self._weights.check(self._comm)  # a rank with n < 1: raised on every rank
        if self.selector is not None and len(done) == len(self.bucketer.buckets) \
                and not self.selector.fixed:
            self.selector.after_step([b.extra["seconds"] for b in done],
                                     lambda: self.last_wait_s)
            self._settle_auto()

    def _settle_auto(self) -> None:
        """Once auto's choice is fixed, a bucket it left uncompressed is reduced as compressor
        "none" reduces it: averaged on its way into the bucket, then summed (no pass over the
        bucket after the reduction: 2-3 ms of the engine thread a step on gpt-small)."""
        if self.selector.fixed and self.world > 1:
            for b, spec in zip(self.bucketer.buckets, self.selector.choice):
                b.scale = 1.0 / self.world if spec == "none" else None
            if self._regroup and all(spec == "none" for spec in self.selector.choice):
                self._regroup = "next"  # at the next forward: backward's hooks are done

    def _rebucket(self) -> None:
        """auto settled on "none" everywhere at the default bucket size: regroup into compressor
        none's buckets (DDP's 25 MB), reduced as none reduces them. gpt-small, 2 ranks on this
        2-core EPYC's loopback, batch 2, under load: 10 collectives a step against 3, and
        auto's process CPU a rank-step +6 to +24 ms over none's (288-358 ms); auto at 25 MB
        buckets -4 (issue 32)."""
        old, dev = self.bucketer, self._params[0].device
        old.close()
        self._settled = self.selector.made["none"]
        self.selector.buckets = []  # its choice stays (the checkpoint's); the old flats go
        self.bucketer = Bucketer(self._named, default_bucket_mb("none"), self._launch,
                                 enabled=self.overlap, views=old.views)
        self.bucketer.scale, self._sum = 1.0 / self.world, True
        self.bucketer.weight = self._weight
        self._direct = True
        self._through = self._guard.passes_through()
        buckets = self.bucketer.buckets
        self.engine_kind = [self.engine] * len(buckets)
        self._band = SideBand([len(b.params) for b in buckets], len(buckets), dev)
        self._regroup = False

    @property
    def last_wait_s(self) -> float:
        """Seconds the last reduction kept the training thread (on CUDA, its stream) waiting
        after backward's last gradient; on CUDA reading it waits for that reduction."""
        if isinstance(self._wait, tuple):
            t0, t1 = self._wait
            t1.synchronize()
            return t0.elapsed_time(t1) / 1e3
        return self._wait

    def _reduce_and_copy(self) -> list:
        band = self._band
        if self._bare:  # no exchange: this rank's own flags
            band.local()
            return self.bucketer.finish(before=self._before_copy)
        # behind the buckets, where they went (a direct bucket and the engine's FIFO would
        # not be ordered on one group: sum_async)
        side = (self._ft.side_band(band) if self._ft is not None else
                band.reduce(None if self._direct else self._engine, self._comm, self._direct))
        if self._through:  # no verdict to wait for: each bucket out once reduced (finish)
            return self._copy_early(band, side)
        try:
            side.wait()  # FIFO behind the buckets: they are done too
        finally:  # wait for every bucket even so: none may run on behind the caller's back
            band.read(self._reducing)
            done = self.bucketer.finish(keep=lambda b, i: band.used(b.index, i),
                                        before=self._before_copy)
        return done

    def _copy_early(self, band, side) -> list:
        """Buckets copied out as each is reduced (Bucketer.finish's early), the side band read
        only if a parameter this rank has no gradient for is reached (SideBand.used)."""
        read = []

        def keep(b, i):
            if band.mine(b.index, i):  # this rank's gradient: used, whatever the others did
                return True
            if not read:
                side.wait()
                band.read(self._reducing)
                read.append(True)
            return band.used(b.index, i)
        try:
            return self.bucketer.finish(keep=keep, before=self._before_copy, early=True)
        finally:  # waited for even after a failure: nothing may run on behind the caller
            if not read:
                side.wait()
                band.read(self._reducing)

    def _before_copy(self, buckets) -> None:
        """Between the wait and the copy into .grad: the non-finite verdict of the step
        (buckets: the bucketer's, all of them)."""
        # pass-through (none, fp16, bf16): no rank sets a flag, so none is read (a host sync)
        extra = [0] * len(buckets) if self._through else self._band.extra()
        flagged = [f or int(b.handle is not None and b.extra.get("fold", False)
                            and not self._guard.reduced_ok(b.extra["c"], b.flat))
                   for f, b in zip(extra, buckets)]
        # the buckets' names, for the message of a "raise": formatted only when one is flagged
        names = [f"{b.name} ({', '.join(b.names[:3])}{'...' if len(b.names) > 3 else ''})"
                 for b in buckets] if any(flagged) else [""] * len(buckets)
        skipped = self._guard.settle(
            flagged, names, lambda i: buckets[i].flat.fill_(float("nan")))
        self._skipped = None if self._through else skipped

    @property
    def skipped(self) -> bool:
        """Whether the last reduction was a skipped (non-finite) step. Under a pass-through
        check_finite="skip" (compressor none, fp16 or bf16) it is read from the reduced buckets
        when asked, the first time (pyfast.comm.guard)."""
        if self._skipped is None:
            self._skipped = not all(all_finite(b.flat) for b in self.bucketer.buckets)
        return self._skipped

    def reduce_gradients(self) -> None:
        """Average the gradients accumulated so far over the group, now, with the configured
        compressor and engine: for backward passes that did not run through this wrapper's
        forward (pyfast's Pipeline.step runs one backward per micro-batch on the stage modules)
        or ended under no_sync(). Same result as the reduction a synced backward does. `last_wait_s` is the time spent
        here (nothing overlaps this call: it launches and waits for every bucket)."""
        self._check_usable()
        if self._regroup == "next":
            self._rebucket()
        self._weights.start(self._issue)
        self.bucketer.arm(self._finish)
        self.bucketer.flush()

    def sync_buffers(self) -> None:
        """Broadcast group rank 0's buffers to every rank now."""
        self._check_usable()
        self._sync_buffers()

    def _sync_buffers(self) -> None:
        bufs = list(self.module.buffers())
        if bufs:
            with self._breaker.guard("DataParallel buffer broadcast"):
                broadcast_coalesced(bufs, self._comm)

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this DataParallel was closed; call the wrapped .module directly")
        self._breaker.check()
        self._watch.check(self.bucketer.ready.incomplete)

    def forward(self, *args, **kwargs):
        if self._bare:
            self._breaker.check()
        else:
            self._check_usable()
        if torch.is_grad_enabled() and self._sync:
            if self.broadcast_buffers and not self._bare:
                self._sync_buffers()
            if self._regroup == "next":
                self._rebucket()
            self._weights.start(self._issue)
            self.bucketer.arm(self._finish)
        else:
            self.bucketer.disarm()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block reduces them all."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ------------------------------------------------------------------ state
    def compression_state_dict(self) -> dict:
        if self.selector is not None:
            return self.selector.state_dict()
        return {"spec": self.compressor.spec, "state": self.compressor.state_dict()}

    def load_compression_state_dict(self, state: dict) -> None:
        mine = "auto" if self.selector is not None else self.compressor.spec
        if state.get("spec") != mine:
            raise ValueError(f"compression state is for {state.get('spec')!r}, this DataParallel "
                             f"uses {mine!r}")
        if self.selector is None:
            self.compressor.load_state_dict(state["state"])
            return
        self.selector.load_state_dict(state)
        self._settle_auto()

