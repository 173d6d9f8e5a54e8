"""DataParallel's gradient reduction under torchft: the buckets averaged over the replica groups
on Replicas.group (pyfast.parallel.ft), a failure reported instead of raised, and the
compression state kept or dropped by torchft's commit.

Per bucket, on every rank of every replica group:

1. with more than one dp rank in the replica group (`local`), an exact fp32 sum inside the
   group first (the backend's plain all-reduce: the fast link of a node);
2. the compressed sum over the participating replica groups on Replicas.group (each rank with
   the same-ranked rank of every other group: where the slow link is, compression is), error
   feedback included;
3. divided by local ranks x Replicas.participants, read at this step (never a cached world:
   the number of groups changes when one dies or heals).

With n local ranks every one of them runs step 2 on the whole bucket (the n pairings carry the
same data, so each rank's memory and result are the same): n times the cross-group bytes a
sharded reduction (reduce-scatter inside, the shard across, all-gather inside) would send.
That variant is left to ZeRO's hybrid sharding.

Error-feedback memory and compressor state (PowerSGD's Q, shared seeds) advance only when the
step commits: the reducer's FiniteGuard stages every step (`hold`), and Replicas' commit or
rollback hook keeps or drops it. A group that heals receives the compressor state (PowerSGD's
warm-start Q, the shared-seed step counters: what must be equal on every rank for the
reduction to be right) through torchft's transport, under "DataParallel.compression", and
starts with an empty error-feedback memory: a memory is one rank's own residual, the part of
its gradients not yet sent; a copy of the peer's would send that residual twice (once from
each), a bias of residual / participants in the next steps' average, while an empty one is
exactly what a fresh rank owes. The residual of the group that died is lost with it.
"""
from __future__ import annotations

import contextlib
import copy

import torch.distributed as dist

from pyfast.comm import all_reduce
from pyfast.comm.collectives import Handle, NonFiniteGradient, all_reduce_pieces
from pyfast.parallel.ft import FTError


def check(engine: str, auto: bool) -> str:
    """The engine DataParallel runs under torchft; FTError for what cannot run there."""
    if engine == "native":
        raise FTError("DataParallel(replicas=...): the native engine cannot abort a collective "
                      "whose peer died; use engine='python'")
    if auto:
        raise FTError("DataParallel(replicas=...): compressor='auto' times and agrees on its "
                      "choice across a fixed group, which torchft reconfigures; name a compressor")
    return "python"  # engine "auto" or "python"


def without_memory(state: dict) -> dict:
    """A DataParallel's compression_state_dict() for a healing group: the compressor state,
    copied (torchft's transport may read it after this step moved on), with an empty
    error-feedback memory (module docstring)."""
    out = {k: v for k, v in state.items() if k != "state"}
    inner = state.get("state", {})
    if isinstance(inner, dict) and "feedback" in inner:
        inner = {**inner, "feedback": {"memory": {}}}
    out["state"] = copy.deepcopy(inner)
    return out


class ReplicaReduce:
    """The replica dimension of one DataParallel (module docstring). guard: its FiniteGuard;
    local: its own group (this replica group's dp ranks); state: (state_dict, load_state_dict)
    of its compression state, sent to a healing group."""

    def __init__(self, replicas, guard, local, state):
        self.replicas, self.local = replicas, local
        self.n_local = dist.get_world_size(local)
        guard.hold = True
        replicas.on_commit(guard.commit, guard.rollback)
        taken = sum(k.startswith("DataParallel.compression")
                    for k in replicas.manager._user_state_dicts)
        save, load = state
        replicas.register(f"DataParallel.compression{f'.{taken}' if taken else ''}", save, load)

    @property
    def group(self):
        return self.replicas.group

    def reduce_async(self, bucket, c, pieces: bool) -> Handle:
        """Steps 1-3 for bucket.flat, queued on comm's FIFO worker (in order with the others)."""
        r, flat = self.replicas, bucket.flat
        if not r.participating:  # a spare (torchft's fixed-with-spares): contributes nothing
            flat.zero_()
        handles = []
        if self.n_local > 1:
            handles.append(all_reduce(flat, None, self.local, op="sum", async_op=True,
                                      name=f"{bucket.name}.local"))
        if pieces:  # a matrix to factor, a selection: each parameter alone
            handles.append(all_reduce_pieces(
                flat, [(n, o, p.shape) for p, n, o in
                       zip(bucket.params, bucket.names, bucket.offsets)],
                c, r.group, op="sum", name=bucket.name))
        else:
            handles.append(all_reduce(flat, c, r.group, op="sum", async_op=True,
                                      name=bucket.name))
        return self._averaged(Handle.of_all(handles), flat)

    def _averaged(self, h: Handle, flat) -> Handle:
        def join(timeout):
            h.wait(timeout)
            flat.div_(self.n_local * self.replicas.participants)
            return flat, h.seconds
        return Handle(join, lambda: h.seconds, h.is_completed)

    def side_band(self, band) -> Handle:
        """The used / non-finite flags summed over every rank of every participating group,
        behind the buckets on the FIFO worker."""
        first = band.reduce(None, self.local if self.n_local > 1 else self.group)
        if self.n_local == 1:
            return first
        return Handle.of_all([first, all_reduce(band.t, None, self.group, op="sum",
                                                async_op=True, name="sideband")])

    @contextlib.contextmanager
    def reported(self):
        """A failed reduction (a peer group died) is torchft's to handle: reported, so that no
        group commits the step, and not raised (the module stays usable; the next quorum
        reconfigures the group)."""
        try:
            yield
        except NonFiniteGradient:  # check_finite="raise": the caller's to see, as without torchft
            raise
        except Exception as e:  # noqa: BLE001 - whatever the backend raised for a dead peer
            self.replicas.report(e)
