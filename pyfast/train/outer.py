"""The job's DiLoCo glue (--diloco H --replicas R): the outer optimizer over the replica group,
what a step records about it, and what a checkpoint holds of it.

Each replica is the ordinary job on its inner mesh (Mesh(..., replicas=R): contiguous ranks);
DiLoCo (pyfast.parallel.DiLoCo) wraps the inner optimizer and synchronizes each rank's own
parameters (its tp shard, its pipeline stage) with the same ones in the other replicas.

Checkpoints. Between outer steps the replicas' parameters and inner optimizer states differ,
so a checkpoint keeps each replica's: replica 0's under the job's usual "model" / "optim"
keys, replica K's under "replicaK" (written once per replica: DCP keeps one copy of what the
ranks of a replica's dp group hold alike); the outer state (global parameters, outer
momentum, the averaged pseudo-gradient of a fragment in flight: bit-identical on every
replica) once, under "outer", by parameter name (tp shards as DTensors), so DCP reshards it
like the model; its scalars (step, H, F, tau, the fragment in flight) in the "outer_meta"
blob. Each rank's error-feedback residuals (flat over its own shard, by fragment) go into its
per-rank blob, restored on the same mesh only. A run resumed with another number of replicas
takes the outer state as saved and, for replica K, the parameters and AdamW state of replica
K mod R_saved; the residuals then start empty.
"""
from __future__ import annotations

import torch

from pyfast.parallel.diloco import fragment_due
from pyfast.perf import clock

from .config import ConfigError
from .telemetry import bytes_written


def build(cfg, module, opt, mesh):
    """DiLoCo over mesh.replica_group with the job's flags; ConfigError for what only the
    model tells (more fragments than this rank's parameter tensors, ...)."""
    from pyfast.parallel import DiLoCo
    try:
        return DiLoCo(module, opt, sync_every=cfg.diloco, outer_lr=cfg.outer_lr,
                      outer_momentum=cfg.outer_momentum, nesterov=cfg.outer_nesterov,
                      fragments=cfg.fragments, delay=cfg.diloco_delay, alpha=cfg.diloco_alpha,
                      compressor=cfg.outer_compress, error_feedback=cfg.error_feedback == "on",
                      group=mesh.replica_group)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--diloco {cfg.diloco}: {e}") from None


def per_replica(vec: torch.Tensor, i: int, mesh) -> torch.Tensor:
    """vec with its entry i moved into a slot of this replica's own (vec's length + replica):
    after a sum over the world, slot 4 + k holds replica k's sum and entry i holds 0."""
    slots = torch.zeros(mesh.replicas, dtype=vec.dtype, device=vec.device)
    slots[mesh.replica_rank] = vec[i]
    out = torch.cat([vec, slots])
    out[i] = 0.0
    return out


class Meter:
    """Times DiLoCo's step and says what it did: outer_sent / outer_applied (the fragment whose
    all-reduce started / whose outer step was applied after this inner step, or None),
    outer_payload_bytes (this rank's compressed pseudo-gradient sent this step) and outer_bytes
    (what this rank wrote inside the call: its whole all-reduce when delay is 0; with a delay
    the transfer runs behind the next inner steps and lands in their bytes_sent). No
    collective: rank 0's own counts, the same on every rank of a symmetric all-reduce. On a
    step that applies an outer step, the time beyond the last plain inner step is exposed
    communication (returned)."""

    def __init__(self):
        self.inner_s, self.last = 0.0, {}

    def step(self, job) -> float:
        dl = job.diloco
        w, t, paid = bytes_written(), clock(job.device), dl.payload_bytes
        dl.step()
        dt, sent = clock(job.device) - t, bytes_written() - w
        n, due = dl.step_count, lambda t: fragment_due(t, dl.H, dl.F)
        applied = due(n - dl.delay) if n > dl.delay else None
        # None for formats of data-dependent size (top-k, PowerSGD): DiLoCo does not count them
        size = None if paid is None else dl.payload_bytes - paid
        self.last = {"outer_sent": due(n), "outer_applied": applied, "outer_bytes": sent,
                     "outer_payload_bytes": size, "outer_ms": 1e3 * dt}
        if applied is None and due(n) is None:
            self.inner_s = dt
            return 0.0
        return max(0.0, dt - self.inner_s)

    def record(self) -> dict:
        return dict(self.last)


# ---------------------------------------------------------------- checkpoints
def _replica_key(k: int) -> str | None:
    """Where replica k's local state sits: replica 0's under the job's usual "model"/"optim"
    (so that pyfast export and a look at the checkpoint find a model there), the others' under
    "replicaK"."""
    return None if k == 0 else f"replica{k}"


def _by_name(job):
    """(DiLoCo's parameter name -> (the model's FQN, the parameter)), the tp sub-mesh."""
    fqn = {id(p): n for n, p in job.named}
    dl = job.diloco
    tp_mesh = job.mesh.device_mesh["tp"] if job.cfg.tp > 1 else None
    return {n: (fqn[id(p)], p) for n, p in zip(dl.names, dl.params)}, tp_mesh


def state(job, st: dict, replica: int, pending: int | None = -1) -> dict:
    """Job.state's `st` with DiLoCo's: replica `replica`'s local model/optim moved to its key,
    the outer state (global parameters, momentum, a fragment in flight: the same on every
    replica) by FQN under "outer", its scalars (step, schedule, the fragment in flight) in the
    "outer_meta" blob. pending: -1 to save (from DiLoCo), else the fragment in flight that a
    load will read (None: none)."""
    from . import checkpoint as ck
    dl = job.diloco
    key = _replica_key(replica)
    if key is not None:
        st[key] = {"model": st.pop("model"), "optim": st.pop("optim")}
    names, tp_mesh = _by_name(job)
    sd = dl.state_dict() if pending == -1 else None
    outer = {"global": {}, "momentum": {}}
    for what, live in (("global", dl.global_params), ("momentum", dl.momentum_buffers)):
        for n, t in live.items():
            fq, p = names[n]
            outer[what][fq] = ck.shard(t, p, tp_mesh)
    meta = {"step": dl.step_count, "sync_every": dl.H, "fragments": dl.F, "delay": dl.delay,
            "pending": None}
    if sd is not None and sd["pending"]:
        pend = sd["pending"]
        meta["pending"] = {"fragment": pend["fragment"], "sent_at": pend["sent_at"]}
        parts = pend["delta"].split([p.numel() for _, p in _members(dl, pend["fragment"])])
        outer["pending"] = {names[n][0]: ck.shard(d.view(p.shape).clone(), p, tp_mesh)
                            for (n, p), d in zip(_members(dl, pend["fragment"]), parts)}
    elif pending not in (-1, None):
        outer["pending"] = {names[n][0]: ck.shard(torch.empty_like(p, dtype=torch.float32),
                                                  p, tp_mesh) for n, p in _members(dl, pending)}
    st["outer"] = outer
    st["outer_meta"] = ck.blob(meta)
    return st


def _members(dl, f: int):
    """(name, parameter) of fragment f, in the order of its flat buffer."""
    index = {n: p for n, p in zip(dl.names, dl.params)}
    return [(n, index[n]) for n in dl.fragments[f]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def saved_meta(path) -> dict:
    """The outer scalars of checkpoint `path` (collective: a DCP load of one blob), which a
    load needs first (the fragment in flight decides which tensors to read)."""
    from . import checkpoint as ck
    st = {"outer_meta": ck.blob(None)}
    ck.load(st, path)
    return ck.unblob(st["outer_meta"])


def load(job, st: dict, meta: dict, mine: dict | None) -> None:
    """DiLoCo's state from a loaded `st` (state(...) filled by DCP); `mine`: this rank's own
    blob when the mesh is the one saved (its error-feedback residuals), else None (residuals
    start at zero)."""
    dl = job.diloco
    names, _ = _by_name(job)
    outer = st["outer"]
    sd = {"step": meta["step"],
          "schedule": {"sync_every": meta["sync_every"], "fragments": meta["fragments"],
                       "delay": meta["delay"], "members": [list(f) for f in dl.fragments]},
          "global": {n: _local(outer["global"][names[n][0]]) for n in dl.global_params},
          "momentum": {n: _local(outer["momentum"][names[n][0]]) for n in dl.momentum_buffers},
          "pending": {}, "compression": dl.compressor.state_dict(), "payload_bytes": 0}
    if meta["pending"]:
        f = meta["pending"]["fragment"]
        flat = torch.cat([_local(outer["pending"][names[n][0]]).reshape(-1)
                          for n, _ in _members(dl, f)])
        sd["pending"] = {**meta["pending"], "delta": flat}
    if mine is not None and "outer_comm" in mine:
        sd["compression"], sd["payload_bytes"] = mine["outer_comm"], mine["payload_bytes"]
    dl.load_state_dict(sd)


def rank_state(job) -> dict:
    """This rank's own part: its error-feedback residuals (by fragment: flat over this rank's
    shard, so they load only on the same mesh) and its payload count."""
    dl = job.diloco
    return {"outer_comm": dl.compressor.state_dict(), "payload_bytes": dl.payload_bytes}
