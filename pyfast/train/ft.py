"""`pyfast train --ft --lighthouse HOST:PORT --replica-id N --min-replicas M [--ft-timeout S]`:
this process group is one replica group of a torchft job (pyfast.parallel.ft.Replicas); the
flags, their checks, and the job's torchft step (FTStep). User guide: docs/fault_tolerance.md.
No torch import at module level (config.py parses flags without torch).

The step, on every rank of every group (the adapter's protocol):

    R.start()                          quorum; a group that is behind heals from a peer first
    forward / backward of this group's micro-batches (DataParallel inside the group, exact)
    the gradient averaged over the participating groups on R.group (--compress)
    if R.commit(): clip, optimizer.step(), scheduler.step()      else nothing moves

The global batch (torchft#302: integral global batches as replicas come and go). --batch B is
cut into T = M x A micro-batches per dp rank (M = --min-replicas, A = --grad-accum) of
u = B / (M x A x dp) sequences each. Step s's global batch is the data's batch s (the same
sequences whatever the participants); with P groups taking part, the group at place q in the
quorum runs micro-batches q, q + P, q + 2P, ... (floor(T / P) or one more: when T % P != 0 the
first T % P groups run one extra), and every micro-batch's loss is weighted P / T, so the
average over the P groups is exactly the mean over the T micro-batches: the batch and the
gradient are the uninterrupted run's whatever P is. A group with no micro-batch (P > T) runs
one at weight 0 (its reductions must still happen). The data position is the committed step,
which a healing group receives with the rest.

With --diloco H (DiLoCo under torchft, pyfast.parallel.diloco_ft) the groups meet only at the
outer steps: inner steps make no torchft call (DataParallel inside the group as without --ft),
each outer step is one torchft step (quorum, heal, --outer-compress average over the
participants, outer SGD only on commit). Group N reads slice N mod M of each global batch of
--batch B (as replica N of --replicas M would); a group that heals takes the peer's inner step
count, data position and LR schedule with its parameters.
"""
from __future__ import annotations

import argparse
from urllib.parse import urlparse


def add_flags(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("per-step fault tolerance through torchft "
                             "(docs/fault_tolerance.md; refused by --dry-run)")
    g.add_argument("--ft", action="store_true", default=d.ft,
                   help="this job is one replica group of a torchft run: every step a quorum "
                        "of the live groups averages their gradients; a dead group is dropped, "
                        "a restarted one heals from a peer")
    g.add_argument("--lighthouse", default=d.lighthouse, metavar="HOST:PORT",
                   help="--ft: a running torchft_lighthouse (torchft_lighthouse --min_replicas "
                        "M --bind [::]:PORT)")
    g.add_argument("--replica-id", type=int, default=d.replica_id, metavar="N",
                   help="--ft: this group's id (a restarted group comes back under its id)")
    g.add_argument("--min-replicas", type=int, default=d.min_replicas, metavar="M",
                   help="--ft: the fewest groups a step commits with; the global batch is cut "
                        "into M x --grad-accum micro-batches per dp rank")
    g.add_argument("--ft-timeout", type=float, default=d.ft_timeout, metavar="S",
                   help="--ft: seconds a peer group may stay silent in a collective or the "
                        "commit vote before the step is abandoned and the group dropped")


# TrainConfig's defaults of the flags that configure --ft (config.py's; a test checks them)
DEFAULTS = {"lighthouse": "", "replica_id": -1, "min_replicas": 1, "ft_timeout": 30.0}


def problem(cfg) -> str | None:
    """What is wrong with the --ft flags, told by flag; None if nothing (config.check raises it
    as a ConfigError; this module imports nothing of config)."""
    if not cfg.ft:
        given = [f"--{k.replace('_', '-')}" for k, v in DEFAULTS.items() if getattr(cfg, k) != v]
        return f"{', '.join(given)} without --ft: they configure it" if given else None
    if not cfg.lighthouse:
        return ("--ft needs --lighthouse HOST:PORT of a running torchft_lighthouse "
                "(torchft_lighthouse --min_replicas M --bind [::]:29510)")
    u = urlparse(cfg.lighthouse if "://" in cfg.lighthouse else f"http://{cfg.lighthouse}")
    try:
        ok = bool(u.hostname) and u.port is not None
    except ValueError:
        ok = False
    if not ok:
        return f"--lighthouse {cfg.lighthouse!r}: expected HOST:PORT (e.g. localhost:29510)"
    if cfg.replica_id < 0:
        return "--ft needs --replica-id N (N >= 0; each replica group its own)"
    if cfg.min_replicas < 1:
        return f"--min-replicas must be >= 1, got {cfg.min_replicas}"
    if not cfg.ft_timeout > 0:
        return f"--ft-timeout must be > 0 seconds, got {cfg.ft_timeout}"
    why = {
        "pp": (cfg.pp > 1, "--ft with --pp {pp}: the pipeline's gradient reduction (after its "
               "schedule) is not routed through torchft's quorum group yet"),
        "zero": (cfg.zero, "--ft with --zero {zero}: ZeRO's reduction across torchft's replica "
                 "groups is not built yet; use DataParallel inside a group (no --zero)"),
        "fp16": (cfg.precision == "fp16", "--ft with --precision fp16: the loss scale and its "
                 "skips are not part of what a healing group receives; use bf16 or fp32"),
        "delay": (cfg.diloco and cfg.diloco_delay, "--ft --diloco with --diloco-delay {delay}: "
                  "each outer step is one torchft step on the caller's thread (delay 0)"),
        "compress": (cfg.diloco and cfg.compress not in ("none", "") and cfg.dp * cfg.cp == 1,
                     "--ft --diloco with --compress {compress}: --compress is DataParallel's "
                     "inside a group (dp x cp = 1 here: nothing to reduce); the groups' outer "
                     "reduction takes --outer-compress"),
        "elastic": (getattr(cfg, "elastic", False), "--ft with --elastic: a group that re-plans "
                    "its dp at a restart is not combined with torchft's heal yet; restart a group "
                    "at its own size (torchft drops and re-admits whole groups)"),
        "replicas": (cfg.replicas > 1, "--ft with --replicas {replicas}: under --ft every replica "
                     "group is a `pyfast train` of its own (--replica-id); the replica dimension "
                     "is torchft's"),
    }
    for bad, msg in why.values():
        if bad:
            return msg.format(pp=cfg.pp, zero=cfg.zero, replicas=cfg.replicas,
                              delay=cfg.diloco_delay, compress=cfg.compress)
    if cfg.compress == "auto":
        return ("--ft with --compress auto: auto times and agrees on its pick across a fixed "
                "group, which torchft reconfigures; name a compressor")
    per = cfg.min_replicas * cfg.grad_accum * cfg.dp
    if cfg.batch % per:
        return (f"--ft: --batch {cfg.batch} is not divisible by min-replicas {cfg.min_replicas} x "
                f"grad-accum {cfg.grad_accum} x dp {cfg.dp} = {per} (the micro-batches a step "
                "shares among the groups)")
    return None


def unreachable(cfg, timeout: float = 5.0) -> str | None:
    """The launcher's check before torchrun starts (seconds, not torchft's retries deep in a
    quorum): why nothing answers at --lighthouse, or None."""
    import socket
    if not cfg.ft:
        return None
    u = urlparse(cfg.lighthouse if "://" in cfg.lighthouse else f"http://{cfg.lighthouse}")
    try:
        socket.create_connection((u.hostname, u.port), timeout=timeout).close()
    except OSError as e:
        return (f"--lighthouse {cfg.lighthouse}: no torchft lighthouse answers there "
                f"({e.__class__.__name__}: {e}); start it first: torchft_lighthouse "
                f"--min_replicas {cfg.min_replicas} --bind [::]:{u.port}")
    return None


def dry_problem(cfg) -> str | None:
    """The dry run cannot host torchft: no lighthouse, no peers on torch's fake group."""
    if cfg.ft:
        return ("--dry-run with --ft: a dry run has no lighthouse and no peer groups (torch's "
                "fake process group cannot carry torchft's quorum); drop --ft: the memory of a "
                "replica group is that of this mesh (plus one gradient-sized buffer under --ft)")
    return None


def share(step_q: int, participants: int, total: int) -> tuple[list[int], float]:
    """(the micro-batches j of [0, total) the group at place q of P runs, their loss weight):
    j = q, q + P, ...; weight P / total (module docstring). No micro-batch (P > total): [0] at
    weight 0."""
    mine = list(range(step_q, total, participants))
    if not mine:
        return [0], 0.0
    return mine, participants / total

