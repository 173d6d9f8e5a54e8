"""pyfast.plan.probe_ranks: the planner's probe ranks forked from one server (one server a test
process: every case below and test_plan_measured's probes share it)."""
import json
import os

import pytest

from pyfast.plan import calibrate_link, probe_ranks


def test_ranks_get_their_env_one_thread_and_a_group(tmp_path):
    # a gloo all-reduce over the 2 forked ranks, and a print that must not reach the replies
    code = f"""
import json, os, torch, torch.distributed as dist
print("noise on stdout")
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
open(os.path.join({str(tmp_path)!r}, os.environ["RANK"]), "w").write(json.dumps(
    [os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], torch.get_num_threads(), t.item(),
     os.environ.get("PYFAST_PROBE_TEST")]))
dist.destroy_process_group()
"""
    os.environ["PYFAST_PROBE_TEST"] = "seen"  # the caller's environment reaches the ranks
    try:
        assert probe_ranks.run(code, 2, 120) == [0, 0]
    finally:
        del os.environ["PYFAST_PROBE_TEST"]
    for r in ("0", "1"):
        assert json.loads((tmp_path / r).read_text()) == ["2", r, 1, 3.0, "seen"]
    # the same server serves the next request
    assert probe_ranks.run("pass", 1, 60) == [0]


def test_a_failing_rank_and_a_late_one():
    # (the traceback goes to the server's stderr, this process's when the server started)
    assert probe_ranks.run("import os\nif os.environ['RANK'] == '1': raise ValueError('r1')",
                           2, 60) == [0, 1]
    assert probe_ranks.run("raise SystemExit(3)", 1, 60) == [3]
    assert probe_ranks.run("import sys; sys.exit()", 1, 60) == [0]  # as a script's exit
    assert probe_ranks.run("import time; time.sleep(60)", 1, 0.5) == [None]  # killed


def test_child_raises_with_the_codes():
    with pytest.raises(RuntimeError, match=r"exit codes \[0, 1\]"):
        calibrate_link._child(["-c", "import os; raise SystemExit(int(os.environ['RANK']))"],
                              60, world=2)
    calibrate_link._child(["-c", "pass"], 60, world=2)
