"""Pipeline failures that must never hang: an exception on any rank at any micro-batch (loss_fn,
a stage forward or backward, a stage output whose shape changes mid-step) raises PipelineError on
every rank within seconds, naming the rank, stage and micro-batch where it started; a rank killed
mid-step (SIGKILL) or silent (alive, never stepping) makes the others raise within the user's
`timeout=`, not the group's. A failed Pipeline refuses further steps; a new one on the same
ranks works. The process groups here time out after 30-60 s: every bound below is far under."""
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_utils import RankError, RankPool

pytestmark = pytest.mark.dist
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]
HANG_BOUND = 15.0  # seconds; the group's timeout is 30 s, a fixed pipeline takes well under 1 s


class Trip(nn.Module):
    """Identity that misbehaves at training micro-batch `at` of the first step: "raise" in
    forward, "shape" returns fewer features, "backward" raises in the backward, "kill" SIGKILLs
    its own process, "sleep" stalls."""

    def __init__(self, at, how, rank):
        super().__init__()
        self.at, self.how, self.rank, self.calls = at, how, rank, 0
        self.lin = nn.Linear(8, 8)  # a parameter, so "params" balance has something to weigh

    def forward(self, x):
        x = self.lin(x)
        k, self.calls = self.calls, self.calls + 1
        if k != self.at or not torch.is_grad_enabled():
            return x
        if self.how == "raise":
            raise ValueError("boom in forward")
        if self.how == "shape":
            return x[:, :6]
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "backward":
            return _RaiseInBackward.apply(x)
        raise AssertionError(self.how)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


def _seq(n_stages, where, at, how, rank):
    layers = [nn.Linear(8, 8) if i != where else Trip(at, how, rank) for i in range(n_stages)]
    return nn.Sequential(*layers)


def _batch(rows=16):
    return torch.randn(rows, 8), torch.randn(rows, 8)


def failing(rank, world, schedule, v, case, m=8, later=False):
    """One step that fails as `case` says; returns (error message, seconds to raise), then checks
    that the broken Pipeline refuses a second step and that a fresh Pipeline works. later: a
    good step first, so the failing one sends its first messages in their headers' room."""
    from pyfast.parallel.pipeline import Pipeline, PipelineError
    n = world * v
    calls = []

    def loss_fn(y, t):
        calls.append(1)
        if case == "loss" and len(calls) == 4 + m * later:  # micro-batch 3
            raise ValueError("boom in loss_fn")
        return F.mse_loss(y, t)

    where, how = {"loss": (-1, None), "first": (0, "raise"), "first0": (0, "raise"),
                  "shape": (0, "shape"), "backward": (n // 2, "backward"),
                  "last": (0, "backward")}[case]
    torch.manual_seed(0)
    at = {"first": 1, "first0": 0, "last": m - 1}.get(case, 3) + m * later
    seq = _seq(n, where, at, how or "none", rank)
    pipe = Pipeline.from_sequential(seq, m, schedule, loss_fn, balance=[1] * n, virtual_stages=v)
    x, t = _batch()
    first, last = 0 in pipe.stages, n - 1 in pipe.stages
    if later:
        pipe.step(x if first else None, t if last else None)
    t0 = time.perf_counter()
    try:
        pipe.step(x if first else None, t if last else None)
        return "no error", 0.0
    except PipelineError as e:
        out = (str(e), time.perf_counter() - t0)
    with pytest.raises(PipelineError, match="broken|failed earlier"):
        pipe.step(x if first else None, t if last else None)
    again = Pipeline.from_sequential(_seq(n, -1, 0, "none", rank), m, schedule, F.mse_loss,
                                     balance=[1] * n, virtual_stages=v)
    loss = again.step(x if first else None, t if last else None)
    assert (loss is not None) == last and (loss is None or torch.isfinite(loss))
    return out


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4) as pool:
        yield pool


def _all_raise(results, *patterns):
    for rank, r in enumerate(results):
        assert not isinstance(r, RankError), f"rank {rank}: {r}\n{r.tb}"
        msg, took = r
        assert msg != "no error", f"rank {rank} did not fail"
        assert took < HANG_BOUND, f"rank {rank} took {took:.1f} s to raise: {msg}"
        for p in patterns:
            assert re.search(p, msg), f"rank {rank}: {p!r} not in {msg!r}"


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_loss_fn_failing_at_microbatch_3_raises_everywhere(pool4, schedule, v):
    n = 4 * v
    _all_raise(pool4.run(failing, schedule, v, "loss", timeout=90),
               r"Pipeline\.step", r"\brank 3\b", rf"\bstage {n - 1}\b", r"micro-batch 3\b",
               "loss_fn", "boom in loss_fn")


@pytest.mark.parametrize("case,stage,mb,what", [
    ("first", 0, 1, "boom in forward"),
    ("shape", 0, 3, r"output for micro-batch 3 is .*6.* but earlier"),
    ("backward", 2, 3, "boom in backward"),
    ("last", 0, 7, "boom in backward"),  # the root's last action, its flags' receives posted
])
def test_stage_failures_raise_everywhere(pool4, case, stage, mb, what):
    _all_raise(pool4.run(failing, "1f1b", 1, case, timeout=90),
               rf"\brank {stage}\b", rf"\bstage {stage}\b", rf"micro-batch {mb}\b", what)


@pytest.mark.parametrize("schedule,v,case,stage,mb,what", [
    (*sv, "loss", 4 * sv[1] - 1, 3, "boom in loss_fn") for sv in SCHEDULES] + [
    ("1f1b", 1, "first0", 0, 0, "boom in forward"),  # before rank 0's header of the step
    ("interleaved-1f1b", 2, "first0", 0, 0, "boom in forward"),
    ("1f1b", 1, "backward", 2, 3, "boom in backward")])
def test_failures_in_a_later_step_raise_everywhere(pool4, schedule, v, case, stage, mb, what):
    """The second step of a Pipeline: headers carry their boundary's first message, or an
    error padded to the size the receiver posted."""
    _all_raise(pool4.run(failing, schedule, v, case, later=True, timeout=90),
               rf"\brank {stage % 4}\b", rf"\bstage {stage}\b", rf"micro-batch {mb}\b", what)


# -- dead and silent peers -------------------------------------------------------------------
def doomed(rank, world, victim, how, timeout):
    from pyfast.parallel.pipeline import Pipeline, PipelineError
    torch.manual_seed(0)
    # a Trip on every stage: the victim's fires at micro-batch 2 of the second step
    seq = nn.Sequential(*[Trip(6 + 2 if r == victim else -1, how, r) for r in range(world)])
    pipe = Pipeline.from_sequential(seq, 6, "1f1b", F.mse_loss, balance=[1] * world,
                                    timeout=timeout)
    x, t = _batch(12)
    first, last = rank == 0, rank == world - 1
    # "sleep": the victim waits on a group the pipeline never uses until every other rank has
    # its error (a 2.5 x timeout sleep before: 7.5 s a run, and a bound that a loaded box
    # could outlast), so it is silent for exactly as long as the others need
    side = dist.new_group() if how == "sleep" else None
    pipe.step(x if first else None, t if last else None)  # a good step first
    if how == "sleep" and rank == victim:
        dist.barrier(group=side)  # alive but silent: never calls step
        return "slept", 0.0
    t0 = time.perf_counter()
    try:
        pipe.step(x if first else None, t if last else None)
        return "no error", 0.0
    except PipelineError as e:
        return str(e), time.perf_counter() - t0
    finally:
        if side is not None:
            dist.barrier(group=side)


def test_killed_rank_mid_step():
    with RankPool(3, pg_timeout=60) as pool:
        got = pool.run(doomed, 1, "kill", None, timeout=60, expect_errors=True)
        assert isinstance(got[1], RankError) and got[1].kind == "died", got[1]
        for rank in (0, 2):
            assert not isinstance(got[rank], RankError), f"{got[rank]}\n{got[rank].tb}"
            msg, took = got[rank]
            assert msg != "no error", got[rank]
            assert took < 10, f"rank {rank} took {took:.1f} s"
            assert re.search(r"Pipeline\.step", msg), msg


def test_silent_rank_raises_within_the_users_timeout():
    timeout = 3.0
    with RankPool(3, pg_timeout=60) as pool:
        got = pool.run(doomed, 1, "sleep", timeout, timeout=40, expect_errors=True)
        assert got[1] == ("slept", 0.0), got[1]
        for rank in (0, 2):
            assert not isinstance(got[rank], RankError), got[rank]
            msg, took = got[rank]
            assert msg != "no error"
            # the user's 3 s (a rank may wait it out twice: on the silent peer, then on the
            # end-of-step agreement), far under the group's 60 s
            assert timeout * 0.9 <= took < 3 * timeout + 3, f"rank {rank} raised after {took:.1f} s"
            assert re.search(r"Pipeline\.step", msg), msg
