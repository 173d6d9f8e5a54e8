"""Failures of collectives: one error type that names the operation, process groups with a
user-set timeout, and the broken state a module enters after a failed collective.

A SIGKILLed peer shows up on gloo as "Connection reset by peer" within milliseconds (measured:
0.03 s at 3 ranks on loopback); a silent peer (alive, never calling) only as the group's
timeout, which defaults to 30 minutes. So every module that communicates takes `timeout=`
(seconds or a timedelta) and then runs on a private group with that timeout (NCCL enforces
it by its watchdog, gloo on every operation); without it, the group's own timeout holds.
"""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    """A collective failed (a dead peer, a timeout, a broken link), named by operation and rank.
    The module that raised it is broken: further steps raise instead of pairing mismatched
    collectives with the peers."""


def as_timedelta(timeout) -> datetime.timedelta | None:
    """None, seconds (> 0) or a timedelta (> 0) -> a timedelta or None; ValueError otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        td = datetime.timedelta(seconds=float(timeout))
    else:
        raise TypeError(f"timeout must be seconds or a datetime.timedelta, got {timeout!r}")
    if td.total_seconds() <= 0:
        raise ValueError(f"timeout must be > 0, got {td.total_seconds()} s")
    return td


def group_timeout(group=None) -> datetime.timedelta | None:
    """The timeout `group` (None: the default group) was made with, if the backend says."""
    pg = group if group is not None else dist.group.WORLD
    for dev in ("cpu", "cuda"):  # cpu-literal: backends are registered per device type
        try:
            return pg._get_backend(torch.device(dev)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def new_group_like(group=None, timeout=None):
    """A new process group with the ranks and backend of `group` (default: the default group)
    and `timeout` (default: group's own). Collective over the default group, like
    dist.new_group: every rank calls it at the same point. Ranks may pass different groups (a
    data-parallel group per tensor-parallel rank of a mesh): the groups are exchanged and
    created in one order everywhere."""
    timeout = as_timedelta(timeout) or group_timeout(group)
    world = dist.get_world_size()
    mine = tuple(dist.get_process_group_ranks(group) if group is not None else range(world))
    backend = dist.get_backend(group)
    if len(mine) == world:
        return dist.new_group(timeout=timeout, backend=backend)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    made = None
    for ranks in sorted(set(every)):
        g = dist.new_group(list(ranks), timeout=timeout if ranks == mine else None,
                           backend=backend if ranks == mine else None)
        made = g if ranks == mine else made
    return made


@contextlib.contextmanager
def naming(op: str):
    """Re-raise a backend failure inside the block as CommError naming `op` and this rank (a
    CommError from below gets `op` as a prefix). Other errors (a bug, bad input) pass
    unchanged: only torch.distributed's own errors and the transport's are a CommError."""
    try:
        yield
    except CommError as e:  # from a lower layer: say what it was part of
        raise CommError(f"{op}: {e}") from e
    except RuntimeError as e:
        if not is_backend_failure(e):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CommError(f"{op} failed on rank {rank}: {e}") from e


# gloo raises plain RuntimeErrors (measured: "[.../gloo/transport/tcp/pair.cc:537] Read error
# ...: Connection reset by peer", "Application timeout caused pair closure", "Timed out
# waiting ... for recv operation"); NCCL's come as DistBackendError
_TRANSPORT = ("gloo", "nccl", "connection", "timed out", "timeout", "pair closure",
              "broken pipe", "socket")


def is_backend_failure(e: BaseException) -> bool:
    if isinstance(e, (CommError, dist.DistError)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _TRANSPORT)


class Breaker:
    """The broken state of a module: after trip(error), check() raises, naming the first
    failure, so no rank pairs its next collective with a peer's different one."""

    def __init__(self, what: str):
        self.what, self.error = what, None

    def trip(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def check(self) -> None:
        if self.error is not None:
            raise CommError(f"{self.what} is broken by an earlier failure ({type(self.error).__name__}: "
                            f"{str(self.error)[:300]}); its peers may be dead or a step behind: "
                            "build a new one (after restarting the job)")

    @contextlib.contextmanager
    def guard(self, op: str):
        """naming(op), and trip on any error but ValueError / TypeError (bad input, raised the
        same way on every rank): after anything else mid-collective the ranks may be out of
        step, whatever raised it."""
        try:
            with naming(op):
                yield
        except (ValueError, TypeError):
            raise
        except Exception as e:
            self.trip(e)
            raise
