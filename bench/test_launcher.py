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
