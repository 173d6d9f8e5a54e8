"""NativeEngine: the Python face of the overlap engine in pyfast._C (csrc/engine.cpp).

The engine runs compressed all-reduces first-in first-out on its own C++ thread over a c10d
process group, with the GIL released: the caller (backward) keeps computing while a bucket is
compressed, sent and decoded, and no Python runs on the communication path. It does what
pyfast.comm.all_reduce does for the dense compressors (none, fp16, bf16, int8, int4, fp8, sign,
deterministic rounding, with or without error feedback), bit for bit: the same pieces as
pipelined.py (PYFAST_COMM_CHUNK; PYFAST_COMM_REFERENCE=1 gives the unchunked reference
functions), and the error-feedback memory in the compressor's ErrorFeedback under the names that
path uses, so checkpoints (state_dict) are the same whichever path ran.

Collectives must be issued in the same order on every rank: do not run the engine and the
Python path (or any other collective) on the same group while engine jobs are in flight.
NativeEngine.private(group) gives the engine a process group of its own with the same ranks
(what DataParallel does). close() runs the queued jobs and joins the thread; call it before
dist.destroy_process_group.

It also runs uncompressed fp32 all_gather / reduce_scatter on the same thread
(all_gather_into, reduce_scatter_into): tensor-parallel overlap runs the next chunk's
collective here while the caller multiplies. And reduce_scatter / all_gather through the same
dense compressors, bitwise as pyfast.comm.reduce_scatter / all_gather (sharded.py) with the
error-feedback memory under its names: ZeRO's gradient reduce-scatter and parameter gathers.

CUDA tensors need a CUDA build of pyfast._C (setup.py with a CUDA torch and nvcc;
_C.Engine.cuda_enabled). Then the thread issues each job onto a side stream that waits for the
caller's current stream at submit, with NCCL underneath (csrc/cuda/engine_cuda.cu); wait()
makes the caller's current stream wait for the job, without a host sync, and `seconds` is the
time to issue the job. That path is compiled on a machine without a GPU (make cuda-check) but
has not run there. CUDA tensors also need the engine's group to have a CUDA backend other than
gloo (NCCL): collectives.check_backend refuses them at submit otherwise.

A failed job (a dead peer, the group's timeout) raises failure.CommError from its handle's
wait(), naming the job; the engine is broken from then on: every later job fails with "not
run" instead of pairing with a peer's different collective, and close() still returns (the
worker fails the queued jobs without sending anything).
"""
from __future__ import annotations

import math

import os

import torch
import torch.distributed as dist

import pyfast.compress as C
from pyfast._ranges import ranged
from pyfast.comm import pipelined
from pyfast.comm.failure import naming, new_group_like
from pyfast.comm.collectives import (OPS, Handle, _chunks, algorithm_for, check_backend,
                                     fast_path)


def _kind(c: C.Compressor) -> str | None:
    """The engine's name for c (what c declares as native_kind), or None if only the Python
    path can run it."""
    return c.native_kind


def _job_handle(engine, job: int, t: torch.Tensor, what: str) -> Handle:
    """The collectives.Handle of engine job `job` (engine: a pyfast._C.Engine): wait() returns t
    once the job is done (raises what the worker raised, as a CommError naming `what` if the
    backend failed); `seconds` is the time the job took on the engine's thread (NaN until it is
    done)."""

    def join(timeout):
        if timeout is not None:
            raise ValueError("the native engine's handles wait without a timeout")
        with naming(what):
            return t, engine.wait(job)  # releases the GIL
    # done: the worker's time is known (NaN while queued or running): what lets zero's offload
    # copy a finished unit to the host during backward (Handle.is_completed)
    return Handle(join, lambda: engine.seconds(job),
                  lambda: not math.isnan(engine.seconds(job)))


def private_group(group=None, timeout=None):
    """A new process group with the ranks, backend and timeout of `group` (default: the default
    group; `timeout` overrides), for the engine alone: the engine's thread and the caller's
    issue collectives in an order that differs per rank, which on one shared group would pair
    different collectives. Collective over the default group (failure.new_group_like)."""
    return new_group_like(group, timeout)


def check_device(device: torch.device) -> None:
    """Raise unless the engine takes tensors on `device`: CPU always, CUDA only when pyfast._C
    was built with CUDA."""
    from pyfast import _C
    if device.type == "cuda" and not _C.Engine.cuda_enabled:
        raise RuntimeError(f"pyfast._C was built without CUDA: the native engine cannot take "
                           f"tensors on {device}; rebuild pyfast (pip install "
                           "--no-build-isolation -e .) where torch is a CUDA build and nvcc "
                           "exists, or use pyfast.comm.all_reduce")
    if device.type not in ("cpu", "cuda"):  # cpu-literal: the device types _C.Engine runs
        raise ValueError(f"the native engine takes CPU and CUDA tensors, got one on {device}")


def status(device: torch.device | None = None) -> tuple[bool, str]:
    """(True, "") if the engine can run here on tensors on `device` (None: any it takes), else
    (False, why): what engine="auto" asks before it picks the engine (check_device's rule)."""
    from pyfast.ops._backend import cpp_status
    ok, why = cpp_status()
    if not ok:
        return False, why
    forced = os.environ.get("PYFAST_BACKEND", "auto")
    if forced not in ("auto", "cpp"):  # the engine always runs pyfast._C's kernels
        return False, f"PYFAST_BACKEND={forced} forces other kernels than pyfast._C's"
    if device is not None:
        try:
            check_device(torch.device(device))
        except (RuntimeError, ValueError) as e:
            return False, str(e)
    return True, ""


class NativeEngine:
    def __init__(self, group=None):
        from pyfast import _C  # ImportError here says the extension is not built
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._engine = _C.Engine(self.group)
        self._owns_group = False

    @classmethod
    def private(cls, group=None, timeout=None) -> "NativeEngine":
        """An engine on private_group(group, timeout), destroyed by close()."""
        e = cls(private_group(group, timeout))
        e._owns_group = True
        return e

    def close(self) -> None:
        """Run every queued job, join the worker, refuse new jobs; destroy the group if it was
        made by private(). Idempotent. Handles of jobs submitted before still answer."""
        self._engine.shutdown()  # releases the GIL
        if self._owns_group:
            self._owns_group = False
            dist.destroy_process_group(self.group)

    @staticmethod
    def supports(compressor) -> bool:
        return _kind(C.get(compressor)) is not None

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> Handle:
        """Queue out <- every rank's x in rank order (dist.all_gather_into_tensor): contiguous
        float32 on one device, out.numel() == world * x.numel(). wait() returns out."""
        what = f"all_gather_into of {x.numel()} elements on the native engine"
        self._check(x.device, what)
        return _job_handle(self._engine, self._engine.submit_all_gather(out, x), out, what)

    def reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor,
                            op: str = "sum") -> Handle:
        """Queue out <- part `rank` (of world equal parts) of x_0 + x_1 + ... added in rank order
        in fp32, divided by world for op="avg": contiguous float32 on one device, x.numel() ==
        world * out.numel(). Bitwise independent of the backend's reduction order. wait()
        returns out."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        what = f"reduce_scatter_into of {x.numel()} elements on the native engine"
        self._check(x.device, what)
        return _job_handle(self._engine, self._engine.submit_reduce_scatter(out, x, op == "avg"), out,
                      what)

    @ranged("pyfast.comm.native.reduce_scatter")
    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, compressor=None,
                       op: str = "sum", name: str = "") -> Handle:
        """Queue pyfast.comm.reduce_scatter(out, t, compressor, op=op, name=name) on the engine,
        bit for bit: out <- chunk `rank` of the sum (or average) over ranks of t's flat view cut
        into W equal chunks. compressor "none": the backend's reduce-scatter, as
        comm.reduce_scatter's; the dense ones: chunk i compressed under f"{name}.{i}" (its
        error-feedback memory keyed so), all-to-all, decoded and summed in rank order in fp32.
        t and out: contiguous float32 on one device, t.numel() == world * out.numel(). t, out and
        the memories belong to the engine until the handle's wait() returns out."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        c, kind, what, x, y = self._sharded_args("reduce_scatter", compressor, t, out, name)
        if x.numel() != self.world * y.numel():
            raise ValueError(f"{what}: t has {x.numel()} elements, out {y.numel()}: t must have "
                             f"world ({self.world}) x out.numel() elements")
        per, fb = y.numel(), c.feedback
        ef = [] if kind == "none" or fb is None or per == 0 else \
            [fb._buffer(x[i * per:(i + 1) * per], f"{name}.{i}") for i in range(self.world)]
        job = self._engine.submit_reduce_scatter(
            y, x, op == "avg", kind, c.align, ef, "backend" if kind == "none" else "rank-order")
        return _job_handle(self._engine, job, out, what)

    @ranged("pyfast.comm.native.all_gather")
    def all_gather(self, out: torch.Tensor, t: torch.Tensor, compressor=None,
                   name: str = "") -> Handle:
        """Queue pyfast.comm.all_gather(out, t, compressor, name=name) on the engine, bit for bit:
        out <- every rank's t in rank order; compressed, each rank codes its t once under `name`
        (its error-feedback memory, if any) and every rank decodes every rank's bytes, its own
        included, so out is bit-identical everywhere. Contiguous float32 on one device,
        out.numel() == world * t.numel(). wait() returns out."""
        c, kind, what, x, y = self._sharded_args("all_gather", compressor, t, out, name)
        if y.numel() != self.world * x.numel():
            raise ValueError(f"{what}: t has {x.numel()} elements, out {y.numel()}: out must "
                             f"have world ({self.world}) x t.numel() elements")
        fb = c.feedback
        ef = [] if kind == "none" or fb is None or x.numel() == 0 else [fb._buffer(x, name)]
        job = self._engine.submit_all_gather(y, x, kind, c.align, ef)
        return _job_handle(self._engine, job, out, what)

    def _codec(self, compressor, op: str, python: str):
        c = C.get(compressor)
        kind = _kind(c)
        if kind is None:
            raise ValueError(f"the native engine's {op} does not run {c.spec} (dense, "
                             "deterministic compressors only: none, fp16, bf16, int8, int4, fp8, "
                             f"sign); use {python}")
        return c, kind

    def _sharded_args(self, op: str, compressor, t, out, name: str):
        """reduce_scatter's and all_gather's common checks: (compressor, its kind, the
        operation's label for errors, t and out flat)."""
        c, kind = self._codec(compressor, op, f"pyfast.comm.{op}")
        what = f"{op} of {name or f'a {t.numel()}-element tensor'} ({c.spec}) on the native engine"
        return c, kind, what, self._flat(t, "t", what), self._flat(out, "out", what)

    def _flat(self, t: torch.Tensor, arg: str, what: str) -> torch.Tensor:
        self._check(t.device, what)
        if t.dtype != torch.float32 or not t.is_contiguous():  # wrong dtype: TypeError
            raise (TypeError if t.dtype != torch.float32 else ValueError)(
                f"{what}: {arg} must be contiguous float32, got {t.dtype} on {t.device} "
                f"(contiguous: {t.is_contiguous()})")
        return t.view(-1)

    @ranged("pyfast.comm.native.all_reduce")
    def all_reduce(self, t: torch.Tensor, compressor=None, op: str = "sum", name: str = "",
                   algorithm: str | None = None) -> Handle:
        """Queue the reduction of t (contiguous float32, CPU or CUDA) in place; same meaning of the
        arguments as pyfast.comm.all_reduce. t and the compressor's error-feedback memory
        belong to the engine until the handle's wait() returns."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        c = C.get(compressor)
        kind = _kind(c)
        if kind is None:
            raise ValueError(f"the native engine does not run {c!r} (dense, deterministic "
                             "compressors only); use pyfast.comm.all_reduce")
        self._check(t.device, "the native engine's all_reduce")
        if t.dtype != torch.float32 or not t.is_contiguous():  # wrong dtype: TypeError
            raise (TypeError if t.dtype != torch.float32 else ValueError)(
                f"the native engine reduces contiguous float32 tensors, got {t.dtype} on "
                f"{t.device} (contiguous: {t.is_contiguous()})")
        x = t.view(-1)
        algorithm = algorithm_for(c, x.numel(), self.world, algorithm)
        # As collectives.py / pipelined.py: pieces aligned to the (inner) quantizer's block, so
        # every quantization block is the unchunked one; the pieces must be the same.
        align = c.align
        chunk = pipelined.chunk_elems() if fast_path(t) else 0
        mems = self._feedback(c, x, name, algorithm, align, chunk)
        ef, out = [m[0] for m in mems], [m[1] for m in mems]
        if all(o is e for o, e in zip(out, ef)):  # in place (no step staged: comm.guard)
            job = self._engine.submit(x, kind, align, algorithm, op == "avg", ef, align, chunk)
        else:
            job = self._engine.submit(x, kind, align, algorithm, op == "avg", ef, align, chunk,
                                      ef_out=out)
        label = name or f"a {x.numel()}-element tensor"
        return _job_handle(self._engine, job, t,
                      f"all_reduce of {label} ({c.spec}, {algorithm}) on the native engine")

    def _check(self, device: torch.device, what: str) -> None:
        check_device(device)
        check_backend(device, self.group, what)

    def _feedback(self, c, x, name, algorithm, align, chunk) -> list[tuple]:
        """The memories pyfast.comm.all_reduce would use, created under its names if missing,
        each as (read, write) (ErrorFeedback.pair)."""
        if c.feedback is None or algorithm == "native":
            return []
        fb, n, w = c.feedback, x.numel(), self.world
        unit = align * w if algorithm == "two-phase" else align  # pipelined.py's step rounding
        step = max(n, 1) if chunk <= 0 else -(-chunk // unit) * unit
        bounds = [(a, min(n, a + step)) for a in range(0, n, step)]
        if algorithm == "allgather":
            return [fb.pair(x[a:b], f"{name}.{i}" if len(bounds) > 1 else name)
                    for i, (a, b) in enumerate(bounds)]
        out = []
        for j, (a, b) in enumerate(bounds):
            pre = name if len(bounds) == 1 else f"{name}.{j}"
            parts = _chunks(b - a, w, align)
            out += [fb.pair(x[a + p:a + q], f"{pre}.{i}") for i, (p, q) in enumerate(parts)]
            p, q = parts[self.rank]
            out.append(fb.pair(x[a + p:a + q], f"{pre}.sum"))
        return out
