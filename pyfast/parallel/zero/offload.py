"""Host memory for zero(offload=...): where offloaded shards live and how they move.

`Host(device)` serves one model whose parameters live on `device`:
- host buffers: CPU tensors, pinned when the device is CUDA (a pageable copy is staged by the
  driver through a pinned bounce buffer and cannot overlap compute); on the dry run's meta device
  the host is meta too (nothing is allocated), and every host storage is registered here so the
  dry run's memory tracker (pyfast.train.memory) counts it as host, not device.
- copies: to_host (device -> host) and to_device (host -> device) on a side stream each where the
  device is CUDA, ordered after the work the current stream has queued, returning a Copy whose
  wait() orders the consumer after it (the host thread for a device -> host copy: the CPU is about
  to read it; the current stream for host -> device: the GPU is). On CPU and meta they are plain
  copies (distinct tensors: every offload code path still runs) and wait() does nothing.
- check(nbytes, what): before the first allocation, the host memory this rank needs times the
  ranks on this node (LOCAL_WORLD_SIZE, as torchrun sets it) against MemAvailable; short of it, an
  OffloadError naming both, instead of an OOM kill mid-step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

MODES = (None, "optimizer", "params")
GiB = 2**30
_HOST: dict[int, StorageWeakRef] = {}  # storage key -> weak ref: the host storages, any Host


@dataclass
class Offload:
    """zero(offload=mode, prefetch=, delay=): the model's offload settings and its Host."""
    mode: str
    host: "Host"
    prefetch: int = 1
    delay: bool = False


def check_args(offload, stage: int, prefetch, delay) -> None:
    """ValueError naming the bad zero(offload=, prefetch=, delay=) argument."""
    if offload not in MODES:
        raise ValueError(f"offload={offload!r}: one of {MODES}")
    if offload == "params" and stage != 3:
        raise ValueError(f"offload='params' keeps stage 3's parameter shards in host memory; "
                         f"stage {stage} keeps full parameters on the device (use "
                         "offload='optimizer', or stage=3)")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1 (units fetched ahead), got {prefetch!r}")
    if delay and offload is None:
        raise ValueError("delay=True is the offloaded optimizer's one-step delayed update; "
                         "it needs offload='optimizer' or 'params'")


class OffloadError(RuntimeError):
    """Host memory short of what offload needs, or pinned memory refused; names the bytes."""


def is_host(t) -> bool:
    """Whether tensor (or untyped storage) `t` is an offload host buffer (registered, alive)."""
    s = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    ref = _HOST.get(s._cdata)
    return ref is not None and not ref.expired()


def available_bytes() -> int:
    """MemAvailable (what the kernel can give without swapping), bytes; sysconf's free pages
    where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Copy:
    """A started copy; wait() orders its consumer after it (see the module docstring)."""

    def __init__(self, event=None, host_reads: bool = False, device=None):
        self.event, self.host_reads, self.device = event, host_reads, device

    def wait(self) -> None:
        if self.event is None:
            return
        if self.host_reads:
            self.event.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        self.event = None


class Host:
    """See the module docstring."""

    def __init__(self, device):
        self.device = torch.device(device)
        host = "cpu"  # cpu-literal: host memory is what offload is for (meta on a dry run)
        self.host = torch.device("meta" if self.device.type == "meta" else host)
        self.pin = self.device.type == "cuda"
        self._streams: dict[str, object] = {}

    @property
    def dry(self) -> bool:
        return self.host.type == "meta"

    def register(self, *tensors) -> None:
        """Count these tensors' storages as host memory (e.g. the inner optimizer's state, made
        by the optimizer on the host masters)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                _HOST[s._cdata] = StorageWeakRef(s)
        if len(_HOST) > 4096:  # drop the dead ones now and then, not on every call
            for k in [k for k, r in _HOST.items() if r.expired()]:
                del _HOST[k]

    def empty(self, shape, dtype=torch.float32) -> torch.Tensor:
        """A host buffer (pinned on CUDA), registered as host."""
        try:
            t = torch.empty(shape, dtype=dtype, device=self.host, pin_memory=self.pin)
        except RuntimeError as e:  # cudaHostAlloc refused: locked-memory limits, a full host
            n = torch.Size(shape if isinstance(shape, (tuple, list)) else (shape,)).numel()
            raise OffloadError(
                f"offload: pinned host memory refused for {n * dtype.itemsize / GiB:.2f} GiB "
                f"({tuple(shape) if isinstance(shape, (tuple, list)) else shape} {dtype}): {e}; "
                "raise the locked-memory limit (ulimit -l) or free host memory") from e
        self.register(t)
        return t

    def like(self, t: torch.Tensor, dtype=None) -> torch.Tensor:
        """A host copy of device tensor t (in dtype, default t's)."""
        h = self.empty(t.shape, dtype or t.dtype)
        h.copy_(t)
        return h

    def check(self, nbytes: int, what: str) -> None:
        """OffloadError unless this node's ranks' host bytes (nbytes a rank) fit MemAvailable."""
        if self.dry:
            return  # the planner and the dry run's table judge a meta run's host bytes
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        need, avail = nbytes * local, available_bytes()
        if need > avail:
            raise OffloadError(
                f"offload: {what} needs {nbytes / GiB:.2f} GiB of host memory per rank x {local} "
                f"rank(s) on this node = {need / GiB:.2f} GiB, but only {avail / GiB:.2f} GiB is "
                "available (MemAvailable); use fewer ranks per node, offload less "
                "(offload='optimizer' instead of 'params'), or more ZeRO ranks to shard over")

    def _stream(self, which: str):
        s = self._streams.get(which)
        if s is None:
            s = self._streams[which] = torch.cuda.Stream(self.device)
        return s

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """Copy device tensor src into host buffer dst; wait() before the CPU reads dst."""
        if self.device.type != "cuda":
            dst.copy_(src)
            return Copy()
        s = self._stream("d2h")
        s.wait_stream(torch.cuda.current_stream(self.device))  # src is written by queued work
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        src.record_stream(s)  # the allocator must not reuse src before the copy read it
        return Copy(s.record_event(), True, self.device)

    def settle_h2d(self) -> None:
        """Block the host until every host -> device copy issued so far has read its source:
        before the host writes those buffers again (the next host step). A no-op off CUDA."""
        s = self._streams.get("h2d")
        if s is not None:
            s.synchronize()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """Copy host buffer src into device tensor dst; wait() before the device reads dst (the
        current stream waits on the copy's event; the host does not block)."""
        if self.device.type != "cuda":
            dst.copy_(src)
            return Copy()
        s = self._stream("h2d")
        s.wait_stream(torch.cuda.current_stream(self.device))  # dst may still be read
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        dst.record_stream(s)
        return Copy(s.record_event(), False, self.device)
