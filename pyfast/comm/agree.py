"""Ranks agree before they communicate: one check, used wherever a mistake on one rank (bad
arguments, a tensor or a configuration that differs from the peers') would otherwise hang a
collective, pair pieces of different tensors, or raise on that rank alone while the others wait.

agree(desc, problem, group) raises the same exception, with the same message, on every rank of
the group if any rank has a problem or the ranks' descriptions differ. Cheap path: one exchange
of an 8-byte digest of (desc, problem), 0.6 ms at W=2 on this 2-core machine (loaded), on the
device of the data it guards where the group's backend serves that device, else on the one it
serves (exchange_device). Only when a digest differs or a
rank has a problem does all_gather_object run, to word the error.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from pyfast import _dist

from pyfast.comm.collectives import device_backends
from pyfast.comm.dry import read


# Which device types a backend named alone ("gloo", not "cpu:gloo,cuda:nccl") exchanges tensors
# on; another backend is taken to serve any device. gloo takes CUDA tensors through host copies
# (collectives.check_backend refuses those where data moves; an 8-byte digest may go so).
_SERVES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",)}  # cpu-literal: gloo's device


def _default_device(found: dict) -> torch.device:
    """The device the group's backend exchanges small tensors on: CPU unless only CUDA has one."""
    if "cpu" in found or found.get("*", "nccl") != "nccl":  # cpu-literal: backend per device
        return torch.device("cpu")  # cpu-literal: the group has a CPU backend
    if "cuda" in found or "*" in found:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(next(iter(found)))  # one device type only: a dry run's "meta:fake"


def exchange_device(group=None, device: torch.device | None = None) -> torch.device:
    """Where an agreement's digest travels: `device` (the data's) if the group's backend
    serves that device type, else the device the backend serves (CPU if it has a CPU backend,
    else the current GPU). A job may shard a CPU batch over an NCCL-only group before it
    moves the shards to the GPU: the check must still run on NCCL's device, as must a check of
    meta tensors (a dry run) on a backend that lists cpu and cuda only."""
    found = device_backends(dist.get_backend_config(group))
    if device is not None:
        device = torch.device(device)
        if device.type in found or ("*" in found and device.type in
                                    _SERVES.get(found["*"], (device.type,))):
            return device
    return _default_device(found)


def _all_gather(group):
    def gather(mine: torch.Tensor) -> torch.Tensor:
        every = mine.new_empty(dist.get_world_size(group))
        _dist.all_gather_single(every, mine, group=group)
        return every
    return gather


def rank_by_rank(descs: list) -> str:
    """"rank 0 has X, rank 2 has Y": rank 0's description and those that differ from it."""
    return ", ".join([f"rank 0 has {descs[0]}"]
                     + [f"rank {r} has {d}" for r, d in enumerate(descs) if d != descs[0]])


def _differ(descs: list) -> str:
    return "ranks differ: " + rank_by_rank(descs)


def agree(desc, problem: BaseException | None = None, group=None, *, what: str = "",
          device: torch.device | None = None, differ=_differ, gather=None) -> None:
    """Raise on every rank of `group` (None: the default group) if any rank has a problem or
    the ranks' `desc` differ; return on every rank otherwise. Collective: every rank calls it.

    desc: what must be the same everywhere (a string, a tuple, a list: its repr is hashed).
    problem: this rank's own mistake (an exception, not raised yet) or None. If descriptions
    agree and ranks have problems, every rank raises the type of the first bad rank's problem
    with its message and "(rank(s) [...])" naming the ranks that have one.
    what: the prefix of every message ("reduce_scatter('g')"). differ(descs) -> the message of
    the ValueError raised when descriptions differ (descs in rank order). device: the data's,
    where the digest travels if the group's backend serves it (exchange_device). gather(mine)
    -> every rank's copy of the 1-element int64 tensor `mine`, in rank order: the cheap
    exchange (default all_gather_single over `group`; a caller with a faster one passes it).
    Outside torch.distributed, or alone in its group, it raises this rank's problem only."""
    kind, msg = ((type(problem), str(problem) or type(problem).__name__) if problem is not None
                 else (None, ""))
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        seen = [(desc, kind, msg)]
    else:
        key = repr((desc, kind and kind.__qualname__, msg)).encode()
        digest = int.from_bytes(hashlib.sha256(key).digest()[:8], "little", signed=True)
        mine = torch.tensor([digest], dtype=torch.int64, device=exchange_device(group, device))
        every = (gather or _all_gather(group))(mine)
        same = read(every == mine, [True], group)  # a dry run: every rank is this one
        if not msg and all(same):
            return  # equal digests: every rank has this same description and no problem
        seen = [None] * world
        dist.all_gather_object(seen, (desc, kind, msg), group=group)
    prefix = f"{what}: " if what else ""
    descs = [d for d, _, _ in seen]
    if any(d != descs[0] for d in descs):
        raise ValueError(prefix + differ(descs))
    bad = [r for r, (_, _, m) in enumerate(seen) if m]
    if bad:
        raise seen[bad[0]][1](f"{prefix}{seen[bad[0]][2]} (rank(s) {bad})")
