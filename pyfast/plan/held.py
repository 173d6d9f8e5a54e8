"""What a pipeline stage holds at its memory peak: the schedules' action lists replayed
(pyfast.parallel.schedules), for memory.py. Pure arithmetic, no torch."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def _held(schedule: str, rank: int, p: int, m: int, v: int, weights: tuple,
          w_split: float, w_sent: float = 0.0) -> tuple[tuple[int, ...], int, int, int]:
    """(micro-batches each local (virtual) stage of `rank` holds from F until its backward,
    micro-batches held between I and W) at the moment their bytes (weights[stage] each;
    w_split more for each between I and W, w_sent for each gradient sent) add up most:
    pyfast.parallel.schedules' action lists replayed as schedules.held does. zb-h1's I runs
    autograd with retain_graph=True, so a micro-batch keeps everything until its W, plus the
    output gradients W starts from. The
    last such moment, the backward passes that sent a gradient before it (the gradients exist
    once one ran), and the sent gradients' buffers still held then: p2p.Peer.release drops one
    once a later message from its peer arrives, which a forward's input is, so those sent
    since the last forward and the one before it (1F1B's last stage, 8 micro-batches, holds
    at most 2 payloads, tests/test_pipeline.py; before, every one until the step's end)."""
    ev = []  # (kind, local stage): F holds, B releases, I converts, W releases the converted
    if schedule == "gpipe":  # closed forms of the two common ones (the replay agrees)
        return (m,), 0, 0, 0
    if schedule == "1f1b":
        sent = max(0, m - (p - rank)) if rank > 0 else int(m > p)
        return (min(p - rank, m),), 0, sent, min(sent, 1) if rank > 0 else 0
    if schedule == "gpipe":
        ev = [("F", 0)] * m + [("B", 0)] * m
    elif schedule in ("1f1b", "zb-h1"):
        warm = min(p - 1 - rank, m)
        ev = [("F", 0)] * warm
        done_w = 0
        for k in range(m):
            if k < m - warm:
                ev.append(("F", 0))
            # global stage 0 takes token ids, no input to split the backward at
            # (Pipeline._f: no handle): its I is the whole backward, its W a no-op
            if schedule == "1f1b" or rank == 0:
                ev.append(("B", 0))
            else:
                ev.append(("I", 0))
                if k >= rank:
                    ev.append(("W", 0))
                    done_w += 1
        ev += [("W", 0)] * (m - done_w if schedule == "zb-h1" and rank else 0)
    elif schedule == "interleaved-1f1b":
        rounds = max(1, m // p)
        per = m // rounds
        total = m * v
        warm = min((v - 1) * per + 2 * (p - 1 - rank), total)
        for i in range(total + warm):
            if i < total:
                ev.append(("F", (i // per) % v))
            if i >= warm:
                ev.append(("B", v - 1 - (i - warm) // per % v))
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    # the cost in integer thousandths (the weights come rounded to 3 decimals) kept as a running
    # sum: exact ties, and O(1) an event (the sum over stages each event was 26% of a 16-GPU
    # gpt-7b search with interleaved schedules of up to 2 x 1,024 events)
    wi = [round(w * 1000) for w in weights]
    wsplit, wsent = wi[0] + round(w_split * 1000), round(w_sent * 1000)
    live, split, best, at, sent, since = [0] * v, 0, -1, ((0,) * v, 0, 0, 0), 0, 0
    base = 0  # sum(live[s] * wi[s])
    for kind, s in ev:
        # backward passes so far that sent a gradient back (any but global stage 0); rank 0's
        # first stage sends none, but one there means the gradients exist: count it once
        if kind in ("B", "I"):
            sent += 1 if (s * p + rank > 0 or sent == 0) else 0
            since += 1 if s * p + rank > 0 else 0
        if kind == "F":
            live[s] += 1
            base += wi[s]
            since = 0
        elif kind == "B":
            live[s] -= 1
            base -= wi[s]
        elif kind == "I":
            live[s] -= 1
            base -= wi[s]
            split += 1
        elif kind == "W":
            split -= 1
        kept = min(sent, since + 1) if rank or v > 1 else 0
        cost = base + split * wsplit + kept * wsent
        if cost >= best:
            best, at = cost, (tuple(live), split, sent, kept)
    return at
