"""`pyfast train --batch-split N,N,...`: an uneven split of each global batch over the dp ranks,
for ranks of different speeds (docs/hetero.md, "Sample-weighted data parallel").

The global batch (--batch) keeps its data order: global batch s holds the same rows in the same
order as with the even split (pyfast.data.Batches), and dp rank r takes the contiguous rows
[n_0 + ... + n_{r-1}, + n_r). Each rank's loss is the mean over its own rows, and its gradient
is weighted n_r / --batch in the reduction (DataParallel / zero `samples=`,
pyfast.comm.weights), so the update is that of the whole global batch whatever the split. The
logged loss is the global batch's mean (each rank's mean weighted n_r / --batch), tokens/s
counts the global batch, and the split in force is logged per step in metrics.jsonl
(`"batch_split": [n_0, n_1, ...]`).

Each rank cuts its n_r rows into --grad-accum x --micro-batches equal pieces (the even split's
rule), so every n_r must be a multiple of that. Not with --pp (the pipeline's micro-batches
cross the dp ranks in lock step: use --pp-balance for uneven stages), --diloco, --ft, --replicas
(their replicas or groups would each need a split), --cp > 1 (not tested), or --elastic (which
re-plans --dp): ConfigError naming the flag. `auto` starts from the even split (in units: a
remainder goes to the first ranks) and re-balances by measured speed every --batch-split-every
steps (pyfast.train.rebalance); the same flags are refused with it. The dry run runs the split
(rank r's rows, the weighted reduction on the fake group); with auto, the even split and a
note (dry_note).

No torch import at module level: config.py parses the flags without torch.
"""
from __future__ import annotations

import argparse

from .rebalance import Balancer, even

AUTO = "auto"


def add_flags(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("mixed hardware (docs/hetero.md)")
    g.add_argument("--batch-split", default=d.batch_split, metavar="N,N,...",
                   help="samples of each global batch per dp rank (one number per dp rank, "
                        "summing to --batch, each a multiple of --grad-accum x "
                        "--micro-batches): rank r takes the next n_r rows of the same global "
                        "batch, and its gradient counts n_r / --batch (sample-weighted data "
                        "parallel); for ranks of different speeds. Runs in the dry run too. "
                        "auto: start even, measure each rank's compute seconds per sample and "
                        "re-split in proportion to speed every --batch-split-every steps "
                        "(bounded moves; the dry run runs the even split, with a note). "
                        "Default: the even split")
    g.add_argument("--batch-split-every", type=int, default=d.batch_split_every, metavar="K",
                   help="--batch-split auto: steps per measurement window; the ranks all-gather "
                        "their median seconds per sample and re-split every K steps "
                        f"(default {d.batch_split_every})")


def parse(text: str):
    """None (the even split), AUTO, or the list of ints; ValueError naming the text."""
    text = (text or "").strip()
    if not text:
        return None
    if text == AUTO:
        return AUTO
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--batch-split {text!r}: comma-separated integers, one per dp rank "
                         "(e.g. 3,1), or auto") from None


def unit(cfg) -> int:
    """The samples a rank's share must be a multiple of: its pieces per step."""
    return cfg.grad_accum * cfg.m


def problem(cfg) -> str | None:
    """What is wrong with --batch-split, told by flag and number; None if nothing (config.check
    raises it as a ConfigError; this module imports nothing of config)."""
    try:
        split = parse(cfg.batch_split)
    except ValueError as e:
        return str(e)
    if split != AUTO and cfg.batch_split_every != 10:
        return (f"--batch-split-every {cfg.batch_split_every} tunes --batch-split auto; this "
                f"run has --batch-split {cfg.batch_split or '(even)'}")
    if split is None:
        return None
    text = cfg.batch_split
    for flag, on, why in (
            ("--pp", cfg.pp > 1, "the pipeline's micro-batches run in lock step across the "
             "stages; use --pp-balance for uneven stages"),
            ("--diloco", cfg.diloco, "each replica would need its own split"),
            ("--replicas", cfg.replicas > 1, "each replica would need its own split"),
            ("--ft", cfg.ft, "torchft's groups average by participants, not samples"),
            ("--cp", cfg.cp > 1, "not supported with context parallelism yet"),
            ("--elastic", cfg.elastic, "--elastic re-plans --dp, which the split is for")):
        if on:
            return f"--batch-split {text} with {flag}: {why}"
    if split == AUTO:
        return _auto_problem(cfg)
    if len(split) != cfg.dp:
        return (f"--batch-split {text}: {len(split)} number(s) for --dp {cfg.dp} (one per dp "
                "rank)")
    low = [(r, n) for r, n in enumerate(split) if n < 1]
    if low:
        return (f"--batch-split {text}: every dp rank needs at least one sample "
                f"({', '.join(f'rank {r}: {n}' for r, n in low)})")
    if sum(split) != cfg.batch:
        return f"--batch-split {text} sums to {sum(split)}, but --batch is {cfg.batch}"
    u = unit(cfg)
    odd = [(r, n) for r, n in enumerate(split) if n % u]
    if odd:
        return (f"--batch-split {text}: each rank cuts its samples into --grad-accum "
                f"{cfg.grad_accum} x --micro-batches {cfg.m} = {u} equal pieces, so every "
                f"number must be a multiple of {u}; not: "
                f"{', '.join(f'rank {r}: {n}' for r, n in odd)}")
    return None


def _auto_problem(cfg) -> str | None:
    u = unit(cfg)
    if cfg.batch_split_every < 1:
        return f"--batch-split-every must be >= 1, got {cfg.batch_split_every}"
    if cfg.batch % u:
        return (f"--batch-split auto: --batch {cfg.batch} is not a multiple of --grad-accum "
                f"{cfg.grad_accum} x --micro-batches {cfg.m} = {u} (each rank cuts its rows "
                "into that many equal pieces)")
    if cfg.batch // u < cfg.dp:
        return (f"--batch-split auto: --batch {cfg.batch} holds {cfg.batch // u} piece(s) of {u} "
                f"samples, fewer than --dp {cfg.dp} (every rank needs one)")
    return None


def split_of(cfg) -> list[int] | None:
    """The split the run starts with (checked by problem): the fixed one, auto's start (the
    even split in units), or None: the even split (the plain mean)."""
    s = parse(cfg.batch_split)
    if s == AUTO:
        return even(cfg.batch, cfg.dp, unit(cfg))
    return s if isinstance(s, list) else None


def samples(split, dp_rank: int):
    """DataParallel / zero's `samples=` for this dp rank: its n, or None (the plain mean)."""
    return None if split is None else split[dp_rank]


def mean_of(total, split, dp_rank: int, ways: int, batch: int):
    """This rank's share of the global mean loss, from the mean `total` of its own rows: total /
    ways (the even split: dp x cp ranks, as before), or total * n_r / --batch."""
    return total / ways if split is None else total * (split[dp_rank] / batch)


def record(split) -> dict:
    """metrics.jsonl's field: the split in force this step ({} for the even split)."""
    return {} if split is None else {"batch_split": list(split)}


def describe(split, batch: int) -> str | None:
    """The run's start line for an uneven split (None for the even split)."""
    if split is None:
        return None
    return (f"batch split {','.join(map(str, split))}: dp rank r takes n_r of each global "
            f"batch of {batch}, its gradient weighted n_r / {batch} (sample-weighted data "
            "parallel)")


# --batch-split auto: the job's Balancer (pyfast.train.rebalance) and the dry run's note
def balancer(job):
    """The job's rebalance.Balancer under --batch-split auto (None otherwise, and on the dry run's meta
    tensors, which take no time: dry_note). Starts from job.split (the even split, or the one
    a checkpoint restores through restore())."""
    cfg = job.cfg
    if parse(cfg.batch_split) != AUTO or job.device.type == "meta":
        return None
    return Balancer(job.split, cfg.batch, unit(cfg), job.mesh.dp_rank, cfg.batch_split_every,
                    job.device)


def dry_note(cfg) -> str | None:
    """The dry run's line: auto runs the even split there (meta tensors take no time)."""
    if parse(cfg.batch_split) != AUTO:
        return None
    return ("--batch-split auto runs the even split on the dry run (meta tensors take no time to "
            "measure); a rank's peak grows with its share: size the largest share you expect "
            "with --batch-split N,N,...")
