"""The job's step under --ft (flags, checks and the global-batch rule: ft.py): one torchft step
of this replica group through pyfast.parallel.ft.Replicas.

The job wraps its model in DataParallel(module, --compress, group=dp x cp, replicas=R) even
with one rank a group: every gradient bucket is summed exactly inside the group and averaged
with --compress over the participating groups on R.group while backward runs
(pyfast.parallel.ft_reduce; each rank pairs with the same-ranked rank of every other group, so
tp and cp shards need nothing more); its error-feedback memory and compressor state advance
only when the step commits, and it registers its compression state for a healing group itself.

What a healing group receives besides (R.register here): the trainable parameters, the
optimizer, the LR scheduler with the groups' lrs, the data position; torchft adds its own step
count, which is the job's step.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from pyfast.errors import NonFiniteError
from pyfast.perf import clock

from . import ft as flags
from .telemetry import bytes_written


def replicas(cfg, device):
    """This group's Replicas (a torchft Manager: quorum every step, heal, commit), built before
    the job's DataParallel, which reduces through it."""
    from pyfast.parallel.ft import Replicas, quiet_torchft
    quiet_torchft()
    return Replicas(cfg.lighthouse, cfg.replica_id, cfg.min_replicas, device=device,
                    timeout=cfg.ft_timeout, quorum_timeout=cfg.timeout)


class FTStep:
    def __init__(self, job):
        cfg = self.cfg = job.cfg
        self.job, self.R = job, job.replicas
        self.total = cfg.min_replicas * cfg.grad_accum  # micro-batches per dp rank, all groups
        self.u = cfg.batch // (self.total * cfg.dp)     # sequences a micro-batch
        self.failed = 0  # steps that did not commit
        self._register()

    # ------------------------------------------------------------ what a healing group gets
    def _register(self) -> None:
        job, R = self.job, self.R
        R.register("model", lambda: {n: p.detach() for n, p in job.named}, self._load_model)
        R.register("optim", job.opt.state_dict, job.opt.load_state_dict)
        R.register("train", self._train_state, self._load_train)

    def _load_model(self, sd: dict) -> None:
        with torch.no_grad():
            for n, p in self.job.named:
                p.copy_(sd[n])

    def _train_state(self) -> dict:
        job = self.job
        return {"sched": job.sched.state_dict(), "lrs": [g["lr"] for g in job.opt.param_groups],
                "data": job.batches.state_dict(), "skips": job.skips}

    def _load_train(self, st: dict) -> None:
        job = self.job
        job.sched.load_state_dict(st["sched"])
        for g, lr in zip(job.opt.param_groups, st["lrs"]):
            g["lr"] = lr
        job.batches.load_state_dict(st["data"])
        job.skips = st["skips"]

    def loaded(self, step: int) -> None:
        """After the job loaded a checkpoint of `step`: torchft's step count follows it (a
        peer further on still heals this group at the first quorum). With --diloco torchft
        counts outer steps: those due up to `step`."""
        if self.cfg.diloco:
            from pyfast.parallel.diloco import fragment_due
            dl = self.job.diloco
            step = sum(fragment_due(t, dl.H, dl.F) is not None for t in range(1, step + 1))
        self.R.manager.load_state_dict({"step": step, "batches_committed": step})

    # ------------------------------------------------------------ the loop
    def _done(self) -> int:
        """Steps done: torchft's committed count, or with --diloco DiLoCo's inner step count
        (a heal at an outer step moves it to the peer's)."""
        return self.job.diloco.step_count if self.cfg.diloco else self.R.step

    def steps(self, start: int):
        """The steps this group attempts: the next one after those done, until --steps are
        (a step that does not commit is attempted again)."""
        if start:
            self.loaded(start)
        while self._done() < self.cfg.steps:
            yield self._done() + 1

    def outer_record(self) -> dict:
        """--diloco: the step's number after a possible heal, and the outer step's verdict."""
        dl = self.job.diloco
        rec = {"step": dl.step_count}
        if dl.last_committed is not None:
            rec.update(participants=dl.last_participants, outer_committed=dl.last_committed,
                       quorum_ms=1e3 * self.R.quorum_s)
            dl.last_participants = dl.last_committed = None
        return rec

    def _micro(self, x: torch.Tensor, y: torch.Tensor, j: int):
        job, u = self.job, self.u
        xs, ys = job.shard(x[j * u:(j + 1) * u], y[j * u:(j + 1) * u])
        return xs.to(job.device), ys.to(job.device)

    def train_step(self, _attempt: int) -> dict:
        job, cfg, R = self.job, self.cfg, self.R
        t0, w0 = clock(job.device), bytes_written()
        R.start()  # heals this group first when it is behind
        step = R.step + 1
        P = R.participants
        q = dist.get_rank(R.group) if R.participating else P  # not taking part: weight 0
        mine, weight = flags.share(q, P, self.total)
        job.batches.position = step - 1  # the data position is the committed step
        x, y = job.batches.next()        # this dp rank's B / dp rows of global batch `step`
        job.opt.zero_grad(set_to_none=True)
        job.mult, job.scaling = weight, True
        local = job.scalar(0.0)
        try:
            for i, j in enumerate(mine):
                last = i == len(mine) - 1  # DataParallel reduces inside the group on the last
                sync = contextlib.nullcontext() if job.dp is None or last else job.dp.no_sync()
                with sync:
                    loss = job.piece_loss(*self._micro(x, y, j))
                    loss.backward()
                local += loss.detach().double()
        finally:
            job.scaling = False
        waited = job.dp.last_wait_s if job.dp is not None else 0.0
        tr = clock(job.device)
        for p in job.params:  # a parameter no micro-batch reached: a zero contribution
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in job.params]
        norms = torch.stack(torch._foreach_norm(grads)).double()
        sq = torch.where(job.counted, norms.square(), 0.0).sum()
        bad = (~torch.isfinite(norms).all()).double()
        contrib = local / (cfg.dp * cfg.cp) if job.owns_loss else job.scalar(0.0)
        sent = bytes_written() - w0
        vec = torch.stack([contrib, sq, bad, job.scalar(float(sent))])
        dist.all_reduce(vec)  # inside the group: its loss share, the (identical) norm, bytes
        lossv = vec[:1].float()
        R.average_(lossv, None, "ft.loss")  # the mean over the groups (exact, 4 bytes)
        waited += clock(job.device) - tr
        vals = job._read(vec)[:4]
        loss, gnorm = float(lossv[0]), math.sqrt(vals[1])
        tc = clock(job.device)
        committed = R.commit()  # every rank of every participating group votes
        waited += clock(job.device) - tc
        lr = job.opt.param_groups[0]["lr"]
        if committed:
            if vals[2] > 0 or not math.isfinite(loss) or not math.isfinite(gnorm):
                raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {gnorm} (NaN/Inf "
                                     "in the averaged gradient of every group); stopping "
                                     "before the update, the last complete checkpoint is kept")
            if cfg.clip > 0 and gnorm > cfg.clip:
                torch._foreach_mul_(grads, cfg.clip / (gnorm + 1e-6))
            job.opt.step()
            job.sched.step()
            job.batches.position = step
        else:
            self.failed += 1
        step_s = clock(job.device) - t0
        return {"step": step if committed else R.step + 1, "loss": loss, "lr": lr,
                "grad_norm": gnorm, "tokens_per_s": cfg.batch * cfg.seq / step_s,
                "step_ms": 1e3 * step_s, "compute_ms": 1e3 * (step_s - waited),
                "exposed_comm_ms": 1e3 * waited, "bytes_sent": int(vals[3]),
                "participants": P, "committed": bool(committed),
                "quorum_ms": 1e3 * R.quorum_s, "failed_commits": self.failed}

    def describe(self) -> str:
        c = self.cfg
        return (f"--ft: replica group {c.replica_id} of torchft's lighthouse {c.lighthouse} "
                f"(min {c.min_replicas} groups); a step's batch: {self.total} micro-batches of "
                f"{self.u} sequences a dp rank, shared among the participants; cross-group "
                f"reduction {c.compress} (exact inside the group)")
