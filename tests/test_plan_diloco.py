"""`pyfast plan`'s DiLoCo candidate (pyfast/plan/diloco.py): ranked first where the link
between nodes is slow, below data parallel where it is fast, with a command the job accepts."""
import json
import shlex

import pytest

from pyfast.plan import cli
from pyfast.plan import diloco as D
from pyfast.plan import shapes
from pyfast.plan.cluster import build
from pyfast.plan.search import search
from pyfast.plan.spec import Workload

from test_plan_cli import KEYS, plan

# two nodes of two GPUs: a small search (seconds)
SMALL = ["--model", "gpt-small", "--gpus", "4", "--gpus-per-node", "2", "--seq", "1024",
         "--global-batch", "64"]


def test_slow_link_between_nodes_ranks_diloco_first(capsys):
    rc, out, err = plan(SMALL + ["--inter-bw", "100mbit", "--json", "--top", "5"], capsys)
    assert rc == 0, err
    rows = json.loads(out)["plans"]
    best = rows[0]
    assert list(best) == KEYS + ["replicas", "diloco"]  # the plan's keys describe a replica
    assert all(list(r) == KEYS for r in rows[1:])       # one DiLoCo candidate
    d = best["diloco"]
    assert best["replicas"] == d["replicas"] == 2 and best["dp"] * best["tp"] * best["pp"] == 2
    assert (d["sync_every"], d["fragments"], d["outer_compress"]) == (40, 4, "int4")
    assert 0 <= d["delay"] < 40 // 4 and "+3.4% validation loss" in d["caveat"]
    assert best["command"].endswith(
        f"--diloco 40 --replicas 2 --fragments 4 --diloco-delay {d['delay']} --outer-compress "
        "int4 --nproc 2 --nnodes 2 --node-rank $NODE_RANK --rdzv-endpoint $MASTER_ADDR:29500")
    # the time to target counts DiLoCo's 2x the steps, and still beats dp over 100 Mbit/s
    assert best["step_s"] * D.STEPS_FACTOR < rows[1]["step_s"]


def test_the_diloco_command_passes_the_jobs_checks(capsys):
    from pyfast.train import config as C
    rc, out, err = plan(SMALL + ["--inter-bw", "100mbit", "--json", "--top", "1"], capsys)
    assert rc == 0, err
    cmd = shlex.split(json.loads(out)["plans"][0]["command"])
    flags = cmd[2:cmd.index("--nproc")]
    cfg = C.from_args(C.parser().parse_args(flags))
    C.check(cfg, 4, model=False)
    assert (cfg.replicas, cfg.diloco, cfg.ranks) == (2, 40, 4)


def test_fast_link_keeps_data_parallel_first():
    """400 Gbit/s between nodes: gpt-1b's data parallel (across both nodes) first; the DiLoCo
    candidate is scored and ranked, behind it (its 2x steps are not paid back)."""
    shape, work = shapes.preset("gpt-1b"), Workload(1024, 64, "bf16")
    res = search(shape, work, build(4, 2, "h100", inter_bw="400gbit"), top=10**6,
                 diloco=True, distinct=False)
    at = [i for i, s in enumerate(res.plans) if s.diloco]
    assert len(at) == 1 and at[0] > 0
    best = res.plans[0]
    assert best.diloco is None and best.plan.dp * best.plan.cp >= 2 and best.plan.ranks == 4
    assert best.to_target_s < res.plans[at[0]].to_target_s


def test_outer_cost_amortized_and_hidden_behind_tau():
    """The outer transfer: each rank's 1/(dp x cp) slice of a fragment, int4, over the
    inter-node link; the delay is the smallest that hides it behind that many inner steps;
    a step pays (what is left + the gather, the outer step, the meeting) / (H / F)."""
    shape, work = shapes.preset("gpt-small"), Workload(1024, 64, "bf16")
    slow = build(4, 2, "h100", inter_bw="100mbit")
    s = D.candidate(shape, work, slow, search)
    o = D.outer(shape, s.plan, 0.05, slow, 2)
    n = D.local_params(shape, s.plan) / D.F / (s.plan.dp * s.plan.cp)
    assert o["bytes"] == pytest.approx(n * (0.5 + 4 / 512))
    # 100 Mbit/s: at least the bytes at the rate
    assert o["transfer_s"] >= o["bytes"] / 12.5e6
    assert o["delay"] == min(D.H // D.F - 1, -(-o["transfer_s"] // 0.05))
    assert o["per_step_s"] == pytest.approx(o["exposed_s"] / (D.H // D.F))
    # one node: no candidate
    assert D.candidate(shape, work, build(2, 2, "h100"), search) is None


def test_table_names_the_diloco_row_and_its_caveat(capsys):
    rc, out, err = plan(SMALL + ["--inter-bw", "100mbit", "--top", "3"], capsys)
    assert rc == 0, err
    assert "DiLoCo 2 x " in out  # the mesh column: replicas x one replica's mesh
    assert "note: #1 is DiLoCo across the 2 nodes" in out and "--diloco 40" in out


def test_e3m0_is_known():
    from pyfast.plan import memory, timing
    assert timing.DENSE_BYTES["e3m0"] == timing.DENSE_BYTES["int4"]
    assert timing.rel_error("e3m0") > timing.rel_error("int4")
    assert "e3m0" in memory.BLOCKED and memory.PAYLOAD["e3m0"] == memory.PAYLOAD["int4"]
    res = search(shapes.preset("gpt-tiny"), Workload(64, 8, "fp32"), build(2, 2, "h100"))
    assert res.plans  # nothing else changes on one node
