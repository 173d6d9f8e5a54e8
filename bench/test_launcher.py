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


SEEN = """
import json, os, sys, torch
extra = os.environ["EXTRA_DIR"]
seen = {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "argv": sys.argv,
        "name": __name__, "cwd": os.getcwd(), "threads": torch.get_num_threads(),
        "omp": os.environ["OMP_NUM_THREADS"], "extra_on_path": extra in sys.path,
        "leader": os.getsid(0) == os.getpid(), "mine": os.environ.get("MINE"),
        "launcher_child": os.getppid() == int(os.environ["LAUNCHER_PID"])}
with open(os.path.join(extra, os.environ["MODE"] + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(seen, f)
how = os.environ.get("HOW")
if how == "raise" and os.environ["RANK"] == "1":
    raise ValueError("rank raises saying why")
if how == "kill" and os.environ["RANK"] == "1":
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("how,code", [(None, None), ("raise", 1), ("kill", -9)])
def test_forked_ranks_look_like_fresh_interpreters(tmp_path, monkeypatch, how, code):
    """A `-c` rank on loopback is forked from pyfast._forked's server (PYFAST_RANKS_EXEC=1: a
    fresh interpreter): the same environment, sys.argv and __name__, cwd, PYTHONPATH on
    sys.path, torch threads from OMP_NUM_THREADS, its own session, and the same exit codes and
    stderr (a traceback: exit 1; SIGKILL: -9)."""
    import json
    import os
    monkeypatch.chdir(tmp_path)
    seen = {}
    for mode in ("fork", "exec"):
        monkeypatch.setenv("PYFAST_RANKS_EXEC", "1" if mode == "exec" else "0")
        env = {"EXTRA_DIR": str(tmp_path), "PYTHONPATH": str(tmp_path), "MODE": mode,
               "LAUNCHER_PID": str(os.getpid()),
               "MINE": "x", **({"HOW": how} if how else {})}
        if code is None:
            netns.run_ranks(["-c", SEEN], 2, timeout=60, env=env)
        else:
            with pytest.raises(RuntimeError, match=rf"(?s)rank 1 \(exit {code}\)" + (
                    ".*ValueError: rank raises saying why" if how == "raise" else "")):
                netns.run_ranks(["-c", SEEN], 2, timeout=60, env=env)
        seen[mode] = [json.loads((tmp_path / f"{mode}{r}.json").read_text()) for r in (0, 1)]
    # forked: a child of the server, not of this process (the one difference)
    parent = [s.pop("launcher_child") for s in seen["fork"] + seen["exec"]]
    assert parent == [False, False, True, True]
    assert seen["fork"] == seen["exec"]
    assert seen["fork"][1] == {"rank": "1", "world": "2", "argv": ["-c"], "name": "__main__",
                               "cwd": str(tmp_path), "threads": 1, "omp": "1",
                               "extra_on_path": True, "leader": True, "mine": "x"}
