"""The job's DiLoCo glue (--diloco H --replicas R): the outer optimizer over the replica group,
what a step records about it, and what a checkpoint holds of it.

Each replica is the ordinary job on its inner mesh (Mesh(..., replicas=R): contiguous ranks);
DiLoCo (pyfast.parallel.DiLoCo) wraps the inner optimizer and synchronizes each rank's own
parameters (its tp shard, its pipeline stage) with the same ones in the other replicas.

Checkpoints. Between outer steps the replicas' parameters and inner optimizer states differ,
so a checkpoint keeps each replica's under "replicaK/" (written once per replica: DCP keeps
one copy of what the ranks of a replica's dp group hold alike), and the outer state (global
parameters, outer momentum: bit-identical on every replica) once, under "outer/", with the
fragment schedule; each replica's error-feedback residuals go with its parameters. All of it
by parameter name (tp shards as DTensors), so DCP reshards it like the model. A run resumed
with another number of replicas takes the outer state as saved and, for replica K, the local
state of replica K mod R_saved (its residuals only where K < R_saved: a copy would feed the
same rounding error back twice).
"""
from __future__ import annotations

import torch

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
    """Times DiLoCo's step and counts what it sends: on a step that synchronizes, the time
    beyond the last plain inner step is exposed communication (returned), and the record says
    which fragments synced and the bytes this rank wrote in the call (no collective: rank 0's
    own count, the same on every rank of a symmetric all-reduce)."""

    def __init__(self):
        self.inner_s, self.last = 0.0, {}

    def step(self, job, step: int) -> float:
        dl = job.diloco
        w, t = bytes_written(), clock(job.device)
        dl.step()
        dt, sent = clock(job.device) - t, bytes_written() - w
        synced = synced_fragments(dl)
        self.last = {"outer_sync": synced, "outer_bytes": sent, "outer_ms": 1e3 * dt}
        if not synced:
            self.inner_s = dt
            return 0.0
        return max(0.0, dt - self.inner_s)

    def record(self) -> dict:
        return dict(self.last)


def synced_fragments(dl) -> list[int]:
    """The fragments whose outer all-reduce DiLoCo started or applied in its last step."""
    return list(dl.last_synced)
