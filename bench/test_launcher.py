"""The benchmarks' one rank launcher (pyfast.benchmarks.netns.ranks / run_ranks) on loopback."""
import pytest
import torch
import torch.distributed as dist

from pyfast.benchmarks import netns

PROGRAM = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
assert t.item() == sum(range(1, dist.get_world_size() + 1)), t
rank = dist.get_rank()
dist.destroy_process_group()
if os.environ.get("FAIL_RANK") == str(rank):
    print("rank says why", file=sys.stderr, flush=True)
    sys.exit(3)
"""


def test_a_failed_rank_is_reported_with_its_stderr():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 \(exit 3\).*rank says why"):
        netns.run_ranks(["-c", PROGRAM], 2, timeout=60, env={"FAIL_RANK": "1"})


def test_this_process_joins_as_rank_0():
    with netns.ranks(["-c", PROGRAM], 2, timeout=60, only=[1]) as launch:
        assert launch.store.port > 0  # hosted here on a port the kernel picked: no race
        launch.init_process_group(0, timeout=60)
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 3
        finally:
            dist.destroy_process_group()
        launch.wait()


def _sum_of_ranks(plus):
    t = torch.ones(1) * (dist.get_rank() + plus)
    dist.all_reduce(t)
    return t.item()


def _fail_on(rank):
    if dist.get_rank() == rank:
        raise ValueError("rank says why")
    return "fine"


def _die_on(rank):
    import os
    import sys
    if dist.get_rank() == rank:
        print("rank dies saying why", file=sys.stderr, flush=True)
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # stuck with the dead rank until the pool is torn down


def _pool_env():
    import os
    here = os.path.dirname(os.path.abspath(__file__))  # the ranks import this module by name
    return {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}


def test_a_pool_runs_calls_and_reports_a_rank_error_then_serves_on():
    with netns.pool(2, timeout=60, env=_pool_env()) as launch:
        assert launch.call(_sum_of_ranks, 1) == [3.0, 3.0]
        with pytest.raises(RuntimeError, match=r"(?s)_fail_on:\nrank 1: ValueError: rank says why"):
            launch.call(_fail_on, 1)
        assert launch.call(_sum_of_ranks, 2) == [5.0, 5.0]


def test_a_rank_that_dies_in_a_call_is_reported_with_its_stderr():
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 \(exit 3\).*rank dies saying why"):
        with netns.pool(2, timeout=60, env=_pool_env()) as launch:
            launch.call(_die_on, 0)
