"""context_parallel_attention's agreement, reached once per (group, arguments) and reused.

Checking every call's arguments and agreeing on them (pyfast.comm.agree) cost ~0.6 ms per
attention layer per micro-batch at 2 ranks: a description built and hashed, the shapes
checked, an all-gather posted and waited for, its result read back (on a GPU that read is a
host sync, which stops the CPU from running ahead of the device). Measured on this 2-core
machine (loaded), the wait for the all-gather is nearly all of it: a call that only posted,
waited for and read the all-gather cost 0.61 ms, the full check 0.59. A training loop calls
with the same shapes every time, so each group keeps the arguments its ranks last agreed on,
and a call with the same ones (a hit) waits for nothing: every call, hit or miss, posts one
8-byte all-gather of its arguments' digest on every rank (so the ranks' collectives stay
paired whatever each one's cache says), and a hit reads it later, once it has completed (on
a GPU, from a pinned copy behind an event): at the next call, or while a transfer keeps the
rank waiting (ring_attention's and ulysses' waits poll it). Side by side (2 ranks, the same
loaded machine): a hit 0.25 ms a call, a miss 0.64; what a hit has left is mostly posting the
all-gather on gloo's queue.

  miss (other arguments than the agreed ones; the first call): the full check and comm.agree
       over that all-gather; then these are the group's agreed arguments.

A rank that misses while another hits holds other arguments than the agreed ones (a hit's ARE
the agreed ones): they disagree. The ranks that missed see it in the all-gather (some digests
are the agreed one), swap their descriptions through the job's store, word the error exactly as
comm.agree does ("ranks differ: rank 0 has ..., rank 1 has ...") and store it; the ranks that
hit went on into the ring or the all-to-all, which the others never join: waiting there, they
read their all-gather, find the agreed digest contradicted and raise the same error from the
store. Their transfers stay posted, so the group is broken from then on, as after a failed
ring: every later call raises that error at once. (On a GPU a hit rank does not block on its
transfers: it raises at a later call, once the all-gather's copy has landed; a host sync that
comes first waits for NCCL's timeout instead.)
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import pickle

import torch
import torch.distributed as dist

from pyfast import _dist
from pyfast.comm.agree import agree, rank_by_rank
from pyfast.comm.dry import moved_nothing

MAX_PENDING = 16  # unread all-gathers kept before the oldest is waited for (GPU: a sync 1 in 16)
_STATES: dict = {}


def _pg(group):
    return group if group is not None else dist.distributed_c10d._get_default_group()


class _State:
    def __init__(self, pg):
        self.pg = pg  # held: _STATES is keyed by id(pg), which must not be reused meanwhile
        name = getattr(pg, "group_name", "") or ",".join(
            map(str, dist.get_process_group_ranks(pg)))
        self.prefix = f"pyfast/cp_agree/{name}/"
        self.key = self.desc = self.mine = self.digest = None
        self.calls = 0  # calls so far: every rank counts alike (each posts one all-gather)
        self.pending: collections.deque = collections.deque()  # (call, digest, ready, wait, read)
        self.broken = None  # (type, message) of the disagreement that broke the group


def _state(group) -> _State:
    pg = _pg(group)
    s = _STATES.get(id(pg))
    if s is None or s.pg is not pg:
        s = _STATES[id(pg)] = _State(pg)
    return s


def forget(group=None) -> None:
    """Make `group`'s next call check and agree again, as if its arguments were new (every rank
    at the same point; benchmarks time the uncached path so)."""
    if dist.is_available() and dist.is_initialized():
        s = _STATES.get(id(_pg(group)))
        if s is not None:  # the agreed digest stays: it still tells the others' hits apart
            s.key = None


def _post(s: _State, mine: torch.Tensor, world: int):
    every = mine.new_empty(world)
    return every, _dist.all_gather_single(every, mine, group=s.pg, async_op=True)


def _raise_stored(s: _State, call: int) -> None:
    """The error the ranks that missed at `call` stored (they write it as soon as they have
    read their all-gather and swapped their descriptions)."""
    store = dist.distributed_c10d._get_default_store()
    key = f"{s.prefix}{call}/error"
    store.wait([key])
    s.broken = pickle.loads(store.get(key))
    raise s.broken[0](s.broken[1])


def _read(s: _State, call: int, digest: int, vals: list) -> None:
    """A hit's all-gather: every rank should have sent `digest`, the one agreed at the time."""
    if any(v != digest for v in vals):
        s.pending.clear()
        _raise_stored(s, call)


def _settle(s: _State, wait_oldest: bool = False) -> None:
    """Read the hit all-gathers that have completed (the oldest in any case when asked),
    raising the stored error if one shows a rank without the agreed arguments."""
    while s.pending:
        call, digest, ready, wait, read = s.pending[0]
        if not ready():
            if not wait_oldest:
                return
            wait()
        wait_oldest = False
        s.pending.popleft()
        _read(s, call, digest, read())


def _hit(s: _State, world: int) -> None:
    every, work = _post(s, s.mine, world)
    if moved_nothing(every, s.pg):  # a dry run: nothing was exchanged to read
        return
    if every.device.type != "cuda":  # gloo: is_completed() turns True by itself (collectives)
        s.pending.append((s.calls, s.digest, work.is_completed, work.wait, every.tolist))
    else:
        work.wait()  # the current stream waits for the all-gather; the host does not
        host = torch.empty(every.shape, dtype=every.dtype, pin_memory=True)
        host.copy_(every, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        s.pending.append((s.calls, s.digest, done.query, done.synchronize, host.tolist))
    if len(s.pending) > MAX_PENDING:
        _settle(s, wait_oldest=True)


def settle(group) -> bool:
    """For a rank waiting on a transfer over `group`: raise if a rank disagreed (from the
    all-gathers completed so far); True while some are unread (then poll: wait_polling)."""
    s = _STATES.get(id(_pg(group)))
    if s is None:
        return False
    _settle(s)
    return bool(s.pending)


@functools.lru_cache(maxsize=1)
def waiter() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that wait on transfers while their rank polls (gloo's p2p works cannot be
    polled: Work.is_completed() stays False until wait() runs, measured on torch 2.13)."""
    # several threads: a wait left blocked by a failed ring must not queue another group's
    return concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="pyfast-ring-wait")


def wait_polling(work, poll, every: float) -> None:
    """work.wait() on a waiter thread, calling poll() every `every` seconds until it returns
    (poll raises to give up: a peer failed or disagreed)."""
    done = waiter().submit(work.wait)
    while True:
        try:
            done.result(timeout=every)
            return
        except concurrent.futures.TimeoutError:
            poll()


def refuse(group) -> None:
    """Raise the disagreement that spent `group`, if one did (before anything else is sent)."""
    s = _STATES.get(id(_pg(group)))
    if s is not None and s.broken is not None:
        raise s.broken[0](s.broken[1])


def check(key, group, world: int, device, what: str, describe, problem) -> None:
    """One call's check, collective over `group`: `key` (hashable, cheap to build) names the
    arguments; describe() -> their description and problem() -> this rank's own mistake (an
    exception, not raised) or None are called on a miss only."""
    if world == 1:
        agree(describe(), problem(), group, what=what)  # alone: raises this rank's problem only
        return
    s = _state(group)
    if s.broken is not None:
        raise s.broken[0](s.broken[1])
    _settle(s)
    s.calls += 1
    if key == s.key:
        _hit(s, world)
        return
    desc, bad = describe(), problem()
    got = {}

    def gather(mine):
        every, work = _post(s, mine, world)
        work.wait()
        got["mine"] = mine
        if s.digest is not None and not moved_nothing(every, s.pg):
            vals = every.tolist()
            hits = [r for r, v in enumerate(vals) if v == s.digest]
            if hits and len(hits) < world:  # some have the agreed arguments, some not
                if vals[dist.get_rank(s.pg)] != s.digest:
                    _disagree(s, vals, hits, desc, bad, what)
                _raise_stored(s, s.calls)  # this rank's are the agreed ones (after forget())
        return every
    agree(desc, bad, s.pg, what=what, device=device, gather=gather)
    s.key, s.desc, s.mine = key, desc, got["mine"]
    s.digest = None if moved_nothing(s.mine, s.pg) else int(s.mine.item())


def _disagree(s: _State, vals: list, hits: list, desc, bad, what: str) -> None:
    """This rank missed while ranks `hits` had the agreed arguments: swap the missing ranks'
    descriptions through the store; raise comm.agree's error (stored for the hits)."""
    store = dist.distributed_c10d._get_default_store()
    kind, msg = (type(bad), str(bad) or type(bad).__name__) if bad is not None else (None, "")
    base = f"{s.prefix}{s.calls}/"
    store.set(f"{base}{dist.get_rank(s.pg)}", pickle.dumps((desc, kind, msg)))
    missed = [r for r in range(len(vals)) if r not in hits]
    store.wait([f"{base}{r}" for r in missed])
    seen = [(s.desc, None, "") if r in hits else pickle.loads(store.get(f"{base}{r}"))
            for r in range(len(vals))]
    prefix = f"{what}: " if what else ""
    descs = [d for d, _, _ in seen]
    if any(d != descs[0] for d in descs):
        err = (ValueError, prefix + "ranks differ: " + rank_by_rank(descs))
    else:  # the same description, and problems (as comm.agree words them)
        bad_ranks = [r for r, (_, _, m) in enumerate(seen) if m]
        err = (seen[bad_ranks[0]][1], f"{prefix}{seen[bad_ranks[0]][2]} (rank(s) {bad_ranks})")
    if dist.get_rank(s.pg) == missed[0]:
        store.set(f"{base}error", pickle.dumps(err))
    s.broken = err  # the ranks that hit are left with transfers posted: the group is spent
    raise err[0](err[1])
