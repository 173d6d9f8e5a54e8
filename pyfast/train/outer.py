"""The job's DiLoCo glue (--diloco H --replicas R): the outer optimizer over the replica group,
what a step records about it, where the replicas meet (Meeting: a plain inner step never
crosses between replicas), and what a checkpoint holds of it.

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

import contextlib
import math

import torch
import torch.distributed as dist

from pyfast.comm.dry import read
from pyfast.parallel.diloco import fragment_due
from pyfast.perf import clock

from .config import ConfigError
from .telemetry import bytes_written


def build(cfg, module, opt, mesh, replicas=None):
    """DiLoCo over mesh.replica_group with the job's flags; ConfigError for what only the
    model tells (more fragments than this rank's parameter tensors, ...). module: the rank's
    model, or its zero() wrapper (ZeRO-1/2: the optimizer steps views of its parameters).
    With dp x cp > 1 each rank sends only its 1/(dp x cp) slice of a fragment between the
    replicas (inner_group: the dp x cp ranks hold the same parameters), for the dense outer
    formats; a per-tensor one (top-k, PowerSGD) needs whole tensors: every rank sends all."""
    import pyfast.compress as C
    from pyfast.parallel import DiLoCo
    sliced = cfg.dp * cfg.cp > 1 and not C.get(cfg.outer_compress).per_tensor
    try:
        return DiLoCo(module, opt, sync_every=cfg.diloco, outer_lr=cfg.outer_lr,
                      outer_momentum=cfg.outer_momentum, nesterov=cfg.outer_nesterov,
                      fragments=cfg.fragments, delay=cfg.diloco_delay, alpha=cfg.diloco_alpha,
                      compressor=cfg.outer_compress, error_feedback=cfg.error_feedback == "on",
                      group=mesh.replica_group if replicas is None else None,
                      inner_group=mesh.dp_cp_group if sliced else None,
                      replicas=replicas)  # --ft: torchft's groups (pyfast.train.ft)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--diloco {cfg.diloco}: {e}") from None


def replica_ranks(mesh):
    """This rank's replica, the ranks [k n, (k + 1) n) of its inner mesh, as a process group of
    its own (the step's small all-reduce: Job.train_step). Collective over the default group:
    every rank makes every replica's group, in one order."""
    mine = None
    for k in range(mesh.replicas):
        g = dist.new_group(list(range(k * mesh.inner, (k + 1) * mesh.inner)))
        if k == mesh.replica_rank:
            mine = g
    return mine


class Meeting:
    """Where the replicas compare notes (R > 1). Each step's small all-reduce runs inside a
    replica only: a step over the whole world would cross the slow link between replicas every
    inner step and queue behind an outer all-reduce's bytes (tc tbf), lock-stepping the
    replicas and undoing --diloco-delay's overlap. The replicas meet (one world all-reduce of
    2 + 3 R fp64 values) before every step that sends a fragment (before its all-reduce
    starts: no fragment is then in flight, delay < H / F), at eval and checkpoint steps and
    at the last step: there the mean of the replicas' losses and the bytes all ranks wrote
    since the last meeting are brought across, and a replica that went NaN/Inf since then
    stops every rank with NonFiniteError naming it. Until that meeting the failed replica
    takes no update (step returns True): its ranks run the same collectives as the others',
    so nothing pairs mismatched operations, and no checkpoint is written after the failure."""

    def __init__(self, job):
        self.job, self.failed, self.bytes, self.last = job, None, 0, {}

    def due(self, step: int) -> bool:
        cfg = self.job.cfg
        return (fragment_due(step, cfg.diloco, cfg.fragments) is not None or step == cfg.steps
                or any(every and step % every == 0 for every in (cfg.eval_every, cfg.ckpt_every)))

    def step(self, step: int, loss: float, gnorm: float, vals: list) -> bool:
        """After the replica's own all-reduce (vals: loss, squared norm, NaN/Inf ranks, bytes
        of this replica): True while this replica must hold its update."""
        from pyfast.errors import NonFiniteError
        if self.failed is None and (vals[2] > 0 or not math.isfinite(loss)
                                    or not math.isfinite(gnorm)):
            self.failed = (step, loss, gnorm, int(vals[2]))
        self.bytes += int(vals[3])
        self.last = {}
        if not self.due(step):
            return self.failed is not None
        job, mesh = self.job, self.job.mesh
        R, k = mesh.replicas, mesh.replica_rank
        mine = [0.0] * (2 + 3 * R)
        if mesh.rank % mesh.inner == 0:  # one rank a replica speaks for it
            mine[0], mine[1] = loss / R, float(self.bytes)
            if self.failed is not None:
                mine[2 + 3 * k:5 + 3 * k] = self.failed[:3]
        v = torch.tensor(mine, dtype=torch.float64, device=job.device)
        dist.all_reduce(v)
        got = read(v, [loss, float(self.bytes * R)] + [0.0] * (3 * R))  # dry run: all alike
        self.bytes = 0
        bad = [(r, got[2 + 3 * r:5 + 3 * r]) for r in range(R) if got[2 + 3 * r] > 0]
        if bad:
            what = "; ".join(f"replica {r} at step {int(s)} (loss {lo}, gradient norm {g})"
                             for r, (s, lo, g) in bad)
            raise NonFiniteError(f"step {step}: NaN/Inf in {what}; every replica stops where "
                                 f"they meet (step {step}), before this step's update; the "
                                 "last complete checkpoint is kept")
        self.last = {"replicas_loss": got[0], "replicas_bytes_sent": int(got[1])}
        return False

    def record(self) -> dict:
        return dict(self.last)

    def settle(self, step: int, late: int) -> None:
        """Bytes this replica wrote after its step's meeting (late: the sum over its ranks, the
        outer all-reduce's among them) go into the next meeting's count; at the last step,
        which meets before its update, one more world all-reduce brings them across, so the
        run's replicas_bytes_sent add up to every byte every rank sent in its steps."""
        self.bytes += late
        job = self.job
        if step != job.cfg.steps:
            return
        mine = float(self.bytes) if job.mesh.rank % job.mesh.inner == 0 else 0.0
        v = job.scalar(mine).view(1)
        dist.all_reduce(v)
        got = int(read(v, [mine * job.mesh.replicas])[0])  # dry run: every replica alike
        self.bytes = 0
        self.last["replicas_bytes_sent"] = self.last.get("replicas_bytes_sent", 0) + got


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

    def settle(self, job, step: int, w1: int) -> int:
        """The bytes this rank wrote in its step after the count that went into the step's
        all-reduce (at w1): that all-reduce's own, the meeting's and DiLoCo's step with its
        outer all-reduce. On a step with outer traffic (a fragment sent, in flight or applied)
        and at the last step, returned summed over the replica's ranks (one all-reduce inside
        the replica when it has several) and handed to the Meeting; on the others carried into
        the next step's count (job.carried: no collective), so every byte lands in bytes_sent
        once. What a delayed all-reduce writes after this count, up to the next step, is the
        next step's (Job.mark), except inside the caller's Job.not_sent() (its log and
        checkpoint writes, which wchar cannot tell from the transfer's); at the last step the
        one in flight is waited for (close() applies it), so that its bytes are this step's."""
        dl, last = job.diloco, step == job.cfg.steps
        if last and dl.in_flight is not None:
            dl.in_flight.handle.wait()
        now = bytes_written()
        late = now - w1
        if dl.in_flight is not None:  # it writes on after this count: the next step's (Job.mark)
            job.mark = now
        busy = (self.last.get("outer_sent") is not None or dl.in_flight is not None
                or self.last.get("outer_applied") is not None or last)
        if not busy:
            job.carried = late
            return 0
        if job.mesh.inner > 1:
            v = job.scalar(float(late)).view(1)
            dist.all_reduce(v, group=job.step_group)
            late = int(read(v, [float(late * job.mesh.inner)])[0])
        if job.meeting is not None:
            job.meeting.settle(step, late)
        return late


@contextlib.contextmanager
def swapped(dl):
    """The outer (global) parameters in place of this rank's own for the duration (a fragment
    still in flight is not in them yet); the own ones restored exactly after."""
    with torch.no_grad():
        own = [p.detach().clone() for p in dl.params]
        for n, p in zip(dl.names, dl.params):
            p.copy_(dl.global_params[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for p, o in zip(dl.params, own):
                p.copy_(o)


# ---------------------------------------------------------------- checkpoints
def replica_key(k: int) -> str | None:
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
    key = replica_key(replica)
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
