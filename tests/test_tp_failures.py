"""A dead or silent peer in tensor parallelism never hangs the others.

Three gloo ranks, tp = 3. Rank 2 is SIGKILLed in the middle of a step (forward: a parallelized
embedding + MLP, just before the row layer's all-reduce; backward: a sequence-parallel MLP with
async TP, just before the row layer's overlapped backward all-gather; one kill per phase, as a
pool of 3 ranks costs ~10 s to start here), or stays alive and silent (never calls the
collective). The other ranks must raise CommError naming the module and the operation within
seconds (dead: gloo sees the reset connection; silent: the timeout the
user gave, `timeout=` on parallelize, the layers and async TP's functions), and afterwards the
module refuses further steps (the broken state) instead of pairing a collective with a peer's
different one.

The pools here lose a rank: RankPool.run(expect_errors=True) returns the survivors' results
beside the dead rank's RankError ("died").
"""
import time

import pytest
import torch
from torch import nn

from dist_utils import RankError, RankPool

WORLD = 3
D, F_, V = 6, 12, 9  # divisible by 3
B, T = 2, 6
DEAD_WITHIN = 10.0  # s: generous bound for "within seconds" on a loaded 2-core machine


def _survivors(fn, *args, dead=(2,), timeout=90.0):
    """fn(rank, WORLD, *args) on a fresh pool; the results of the ranks not in `dead`, which
    must have died."""
    with RankPool(WORLD, pg_timeout=30.0) as pool:
        got = dict(enumerate(pool.run(fn, *args, timeout=timeout, expect_errors=True)))
    for r in dead:
        e = got.pop(r)
        assert isinstance(e, RankError) and e.kind == "died", f"rank {r} should have died: {e}"
    bad = {r: f"{e}\n{e.tb}" for r, e in got.items() if isinstance(e, RankError)}
    assert not bad, bad
    return got


def _model(vocab: bool, bias: bool = True):
    torch.manual_seed(0)
    layers = [nn.Embedding(V, D)] if vocab else []
    return nn.Sequential(*layers, nn.Linear(D, F_, bias), nn.GELU(), nn.Linear(F_, D, bias))


def _step(model, x):
    model(x).square().sum().backward()


def _die():
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def _outcome(step, again):
    """(what the first step raised, seconds it took, what a second step raised, seconds)."""
    from pyfast.comm.failure import CommError
    res = []
    for fn in (step, again):
        t0 = time.monotonic()
        try:
            fn()
            res += ["no error", time.monotonic() - t0]
        except CommError as e:
            res += [f"CommError: {e}", time.monotonic() - t0]
        except Exception as e:  # noqa: BLE001  (reported to the parent for the assertion)
            res += [f"{type(e).__name__}: {e}", time.monotonic() - t0]
    return res


def _killed(rank, world, case):
    from pyfast.parallel import parallelize
    if case == "async_tp":  # sequence parallel, overlapped (async TP), tokens split on dim 0
        model = _model(vocab=False, bias=False)  # no bias: no all-reduce of its gradient first
        plan = {"0": ("colwise_sp", {"overlap": 2}), "2": ("rowwise_sp", {"overlap": 2})}
        model = parallelize(model, plan, timeout=5)
        x = torch.randn(4 * world, B, D)[4 * rank:4 * (rank + 1)]
    else:
        model = parallelize(_model(vocab=True), {"0": "vocab", "1": "colwise", "3": "rowwise"},
                            timeout=5)
        x = torch.randint(0, V, (B, T))
    if rank == 2 and case == "forward":  # after the embedding's all-reduce, before the row's
        model[3].register_forward_pre_hook(lambda *_: _die())
    elif rank == 2:  # the row layer's output gradient: before its overlapped backward all-gather
        model[2].register_forward_hook(lambda m, i, y: y.register_hook(lambda g: _die()) and None)
    return _outcome(lambda: _step(model, x), lambda: _step(model, x))


@pytest.mark.parametrize("case, who, op", [
    ("forward", "RowParallelLinear(in_features=12, out_features=6)", "forward all-reduce"),
    ("async_tp", "RowParallelLinear(in_features=12, out_features=6)",
     "backward all-gather (linear_reduce_scatter)"),
])
def test_killed_peer_raises_comm_error_naming_the_op(case, who, op):
    got = _survivors(_killed, case)
    for rank, (first, took, second, took2) in got.items():
        assert first.startswith("CommError: ") and who in first and op in first, (rank, first)
        assert f"failed on rank {rank}" in first, first
        assert took < DEAD_WITHIN, (rank, took)
        # broken: the next step refuses at once, before any collective, naming the failure
        assert second.startswith("CommError: ") and "broken by an earlier failure" in second, \
            (rank, second)
        assert "parallelize(Sequential)" in second and took2 < 1.0, (rank, second, took2)


def _silent(rank, world, timeout, flag_dir):
    """Rank 2 builds everything (construction is collective) but never joins the steps: it
    waits, alive and silent, until the others touched their flag files."""
    import pathlib

    from pyfast.parallel import RowParallelLinear
    from pyfast.parallel.async_tp import all_gather_linear
    row = RowParallelLinear(F_, D, timeout=timeout)
    x = torch.randn(B, F_ // world)
    flags = pathlib.Path(flag_dir)
    if rank == 2:
        deadline = time.monotonic() + 60
        while len(list(flags.iterdir())) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        return "silent"
    out = {"row": _outcome(lambda: row(x), lambda: row(x))}
    # async TP's function on the default group: timeout bounds each wait for a peer's piece
    w = torch.randn(D, D)
    out["agl"] = _outcome(lambda: all_gather_linear(torch.randn(4, D), w, timeout=timeout),
                          lambda: None)
    (flags / str(rank)).touch()
    return out


def test_silent_peer_raises_within_the_user_timeout(tmp_path):
    timeout = 1.5  # the group default here is 30 s: only the user's timeout can fire this soon
    got = _survivors(_silent, timeout, str(tmp_path), dead=())
    assert got.pop(2) == "silent"
    for rank, out in got.items():
        first, took, second, took2 = out["row"]
        assert first.startswith("CommError: ") and "RowParallelLinear(in_features=12, " \
            "out_features=6): forward all-reduce (reduce_from_tp_region) failed" in first, first
        assert timeout * 0.9 <= took < timeout + DEAD_WITHIN, (rank, took)
        assert "broken by an earlier failure" in second and took2 < 1.0, (rank, second, took2)
        first, took, _, _ = out["agl"]
        assert first.startswith("CommError: ") and "all_gather_linear" in first, first
        assert timeout * 0.9 <= took < timeout + DEAD_WITHIN, (rank, took)
