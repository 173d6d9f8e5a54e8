"""DiLoCo's outer step under torchft (DiLoCo(..., replicas=R); pyfast.parallel.ft.Replicas).

The replicas are torchft's replica groups: each outer step (each fragment's, with Streaming
DiLoCo's fragments) is one torchft step, on the caller's thread:

    R.start()          quorum; a group that is behind heals first (the outer state registered
                       here, the model and inner optimizer registered by the caller)
    pseudo-gradient    global - local of the fragment due at DiLoCo's step count (re-read
                       after a heal: the peer's count decides which fragment is due)
    reduction          --compress on R.group, summed, divided by R.participants (never a
                       cached world size); a failure is reported (R.report), not raised
    R.commit()         True: the outer SGD applies (global, momentum, then local = global);
                       False: nothing of the outer state moves, the compressor's error-feedback
                       memory goes back to what it was, and the local parameters keep their
                       inner progress (the next outer step's pseudo-gradient carries it)

Inner steps make no torchft call. A group healed at an outer step holds the peer's global
parameters, momentum, step count and (what the caller registered) local parameters and inner
optimizer: it then contributes the peer's pseudo-gradient once more in that step (torchft's
synchronous quorum: it takes part in the step it joins), and is bit-identical to the peer from
then on. Its compressor memory starts empty (a peer's residual is the peer's: ft_reduce).
No delay (tau = 0): a reduction running behind the inner steps would span quorums.
"""
from __future__ import annotations

import copy

import torch

from pyfast.comm import all_reduce


def check(dl, replicas, group, delay: int) -> None:
    if delay:
        raise ValueError(f"DiLoCo(replicas=...): delay must be 0, got {delay}: each outer step "
                         "is one torchft step (quorum, reduction, commit) on the caller's thread")
    if group is not None:
        raise ValueError("DiLoCo(replicas=...): the replicas are torchft's groups "
                         "(replicas.group); pass group=None")


def attach(dl, R) -> None:
    """Register DiLoCo's outer state for a healing group and its commit / rollback hooks."""
    dl._ft_saved = None
    dl.last_participants, dl.last_committed = None, None

    base = dl.compressor.inner if _feedback(dl) else dl.compressor

    def state():  # the compressor's own state (PowerSGD's Q, seeds: equal on every group)
        return {"step": dl.step_count, "global": dict(dl.global_params),
                "momentum": dict(dl.momentum_buffers), "compressor": base.state_dict()}

    def load(sd):
        with torch.no_grad():
            for key, dst in (("global", dl.global_params), ("momentum", dl.momentum_buffers)):
                for n, t in dst.items():
                    t.copy_(sd[key][n])
        dl.step_count = int(sd["step"])
        if _feedback(dl):  # the peer's compressor state, this group's memory empty
            dl.compressor.load_state_dict({"compressor": sd["compressor"],
                                           "feedback": {"memory": {}}}, dl.device)
        else:
            dl.compressor.load_state_dict(sd["compressor"])

    def keep():
        dl._ft_saved = None

    def rollback():
        if dl._ft_saved is not None:
            dl.compressor.load_state_dict(dl._ft_saved, dl.device)
            dl._ft_saved = None

    R.register("diloco", state, load)
    R.on_commit(keep, rollback)


def _feedback(dl) -> bool:
    import pyfast.compress as C
    return isinstance(dl.compressor, C.WithFeedback)


def outer_step(dl) -> bool:
    """One torchft outer step of the fragment due now (DiLoCo.step calls it when one is due);
    whether it committed."""
    R = dl.ft
    R.start()  # may heal: step_count, global, momentum, local parameters from a peer
    t = dl.step_count
    f = dl.due(t)
    n = sum(dl.params[dl._index[m]].numel() for m in dl.fragments[f])
    flat = torch.empty(n, dtype=torch.float32, device=dl.device)
    with torch.no_grad():
        for name, p, d in dl._views(f, flat):
            d.copy_(dl.global_params[name])
            d.sub_(p.detach())
    mine = dl._slice(flat)
    if dl.payload_bytes is not None:
        k = mine.numel()
        dl.payload_bytes += (dl.compressor.wire_bytes(k) if dl.compressor.algorithm == "dense"
                             else 4 * k)
    if _feedback(dl):
        dl._ft_saved = copy.deepcopy(dl.compressor.state_dict())
    if not R.participating:
        mine.zero_()
    if not R.errored():
        try:
            if dl.compressor.per_tensor:
                for pname, _, d in dl._views(f, mine):
                    all_reduce(d, dl.compressor, R.group, op="sum", name=f"diloco.f{f}.{pname}")
            else:
                all_reduce(mine, dl.compressor, R.group, op="sum", name=f"diloco.f{f}",
                           algorithm=dl.algorithm)
            mine.div_(R.participants)
        except Exception as e:  # noqa: BLE001 - a peer's failure aborts the step everywhere
            R.report(e)
    ok = R.commit()
    dl.last_participants, dl.last_committed = R.participants, ok
    if ok:
        dl._apply_reduced(f, t, flat, mine)
    return ok
