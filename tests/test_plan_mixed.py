"""The planner for mixed clusters (pyfast/plan/nodes.py, mixed.py, mixed_pp.py): the [[nodes]]
format and its errors, the batch split by speed against the even split (checked by hand on
GPUs whose only difference is their FLOP/s), tp / cp / pipeline stages never spanning types,
the printed commands passing the job's own checks, one-type files planning as before.
Pure Python (no torch, no ranks)."""
import json

import pytest

from pyfast.plan import cluster as C
from pyfast.plan import cli, shapes
from pyfast.plan.mixed import (MixedScored, _prediction, _Pricer, largest_remainder,
                               placement_problem,
                               search_mixed, uneven_split)
from pyfast.plan.mixed_pp import pipeline
from pyfast.plan.nodes import MixedCluster
from pyfast.plan.spec import Plan, Workload

# two GPUs that differ only in FLOP/s (2:1): memory-bandwidth terms made negligible (hbm 1e18),
# the same efficiency, so a sample's compute is FLOPs / rate on each and by hand the split is
# in the ratio of the rates
FAST = ('{ name = "fast", memory_gib = 80, flops_16 = 200e12, flops_32 = 20e12, '
        'hbm_bps = 1e18, intra_bw = "300GB/s" }')
SLOW = ('{ name = "slow", memory_gib = 24, flops_16 = 100e12, flops_32 = 10e12, '
        'hbm_bps = 1e18, intra_bw = "300GB/s" }')


WORK = Workload(256, 16, "bf16")


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def nodes(*groups, top=""):
    out = [top]
    for count, per, gpu, extra in groups:
        out += ["[[nodes]]", f"count = {count}", f"gpus_per_node = {per}", f"gpu = {gpu}", extra]
    return "\n".join(out) + "\n"


def test_nodes_file_is_a_mixed_cluster(tmp_path):
    path = write(tmp_path, nodes((2, 4, '"a100-80gb"', 'inter_bw = "200gbit"'),
                                 (1, 8, '{ base = "l40s", memory_gib = 44 }', 'name = "old"')))
    mc = C.build(cluster_file=path)
    assert isinstance(mc, MixedCluster) and mc.gpus == 16 and mc.nodes == 3
    a, b = mc.groups
    assert (a.name, a.gpus, b.name, b.gpus) == ("a100-80gb", 8, "old", 8)
    assert b.cluster.gpu.memory_bytes == 44 * 2**30 and b.cluster.gpu.flops_16 == 362e12
    assert mc.inter_bps == 200e9 / 8  # the slowest NIC (l40s's default 400gbit, a100's 200)
    assert [mc.group_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    # each type priced on the job's slowest link between nodes
    assert mc.for_job(1).inter_bps == 200e9 / 8 and mc.for_job(1).intra_bps == 32e9
    # --inter-bw sets the link between the groups
    assert C.build(cluster_file=path, inter_bw="10gbit").inter_bps == 10e9 / 8


def test_one_type_nodes_file_plans_exactly_as_the_flags(tmp_path, capsys):
    path = write(tmp_path, nodes((1, 2, '"a100-80gb"', ""), (1, 2, '"a100-80gb"', "")))
    assert C.build(cluster_file=path) == C.build(4, 2, "a100-80gb")
    args = ["--model", "gpt-tiny", "--seq", "64", "--global-batch", "12", "--json", "--top", "3"]
    outs = []
    for extra in (["--cluster", path], ["--gpus", "4", "--gpus-per-node", "2", "--gpu",
                                        "a100-80gb"]):
        assert cli.main(args + extra) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1] and "batch_split" not in outs[0]["plans"][0]


@pytest.mark.parametrize("text, words", [
    (nodes((1, 4, '"a100"', "")), ["[[nodes]] #1", "gpu", "'a100' is unknown"]),
    (nodes((1, 4, '"h100"', ""), (1, 4, '"h100"', "speed = 2")),
     ["[[nodes]] #2", "unknown keys ['speed']"]),
    (nodes((0, 4, '"h100"', "")), ["[[nodes]] #1", "count must be an integer > 0, got 0"]),
    (nodes((-2, 4, '"h100"', "")), ["[[nodes]] #1", "count", "got -2"]),
    (nodes((1, 0, '"h100"', "")), ["[[nodes]] #1", "gpus_per_node", "got 0"]),
    ("nodes = []\n", ["nodes must be one or more [[nodes]] tables"]),
    ("[[nodes]]\ncount = 1\ngpus_per_node = 2\n", ["[[nodes]] #1", "missing gpu"]),
    (nodes((1, 4, '"h100"', ""), top="gpus = 8"), ["['gpus'] at the top level", "[[nodes]]"]),
    (nodes((1, 4, '{ base = "h100", tflops = 3 }', "")), ["[[nodes]] #1 [gpu]", "tflops"]),
    (nodes((1, 4, '"h100"', 'inter_bw = "fast"')), ["[[nodes]] #1", "inter_bw"]),
])
def test_bad_nodes_files_name_file_table_and_key(tmp_path, capsys, text, words):
    path = write(tmp_path, text)
    rc = cli.main(["--model", "gpt-tiny", "--seq", "64", "--global-batch", "8",
                   "--cluster", path])
    err = capsys.readouterr().err
    assert rc == 2 and path in err, err
    for w in words:
        assert w in err, (w, err)


def test_flags_that_a_nodes_file_sets_are_refused_by_name(tmp_path, capsys):
    path = write(tmp_path, nodes((1, 2, '"h100"', ""), (1, 2, '"l4"', "")))
    for flag, value in (("--gpus", "4"), ("--gpu", "h100"), ("--gpus-per-node", "2"),
                        ("--intra-bw", "10GB/s"), ("--host-ram", "1TB")):
        rc = cli.main(["--model", "gpt-tiny", "--seq", "64", "--global-batch", "8",
                       "--cluster", path, flag, value])
        err = capsys.readouterr().err
        assert rc == 2 and f"{flag} with --cluster {path}" in err, err


def test_largest_remainder_by_hand():
    assert largest_remainder([2, 2, 1, 1], 12, [1] * 4, [12] * 4) == [4, 4, 2, 2]
    # quotas 5.25 / 1.75: floors 5, 1; the one left to the larger fraction (0.75)
    assert largest_remainder([3, 1], 7, [1, 1], [7, 7]) == [5, 2]
    # a tie in the fractions goes to the first
    assert largest_remainder([1, 1], 3, [1, 1], [3, 3]) == [2, 1]
    # quota 7.3 over the cap 3: clamped, the rest by weight; quota 0.1 under 1 raised to 1
    assert largest_remainder([10, 1], 8, [1, 1], [3, 8]) == [3, 5]
    assert largest_remainder([100, 1], 5, [1, 1], [5, 5]) == [4, 1]
    # a floor met after a cap: 2 + 2 > 3, one unit given back where the bounds allow
    assert largest_remainder([5, 1], 3, [1, 2], [2, 3]) == [1, 2]
    with pytest.raises(ValueError, match="do not fit"):
        largest_remainder([1, 1], 5, [1, 1], [2, 2])


def _pair(tmp_path, per=1):
    return C.build(cluster_file=write(tmp_path, nodes((2, per, FAST, ""), (2, per, SLOW, ""))))


def test_dp_split_in_proportion_to_speed_beats_even_by_hand(tmp_path):
    mc = _pair(tmp_path)
    pr = _Pricer(shapes.resolve("gpt-small", None), WORK, mc)
    plan = Plan(dp=4, micro_batch=4)
    s = MixedScored(plan, _prediction(pr, {0: plan, 1: plan}, [4] * 4), uneven_split(pr, plan))
    # by hand: the fast replicas' rate is twice the slow ones' (same FLOPs a sample): quotas
    # 16 x 2/6, 2/6, 1/6, 1/6 = 5.33, 5.33, 2.67, 2.67; floors 5, 5, 2, 2 and the 2 units
    # left to the largest fractions (0.67: the slow ones) = 5, 5, 3, 3. In slow-sample times
    # the ranks then take 2.5, 2.5, 3, 3; moving a unit from a slow rank (3) to a fast one
    # (3 as well) gains nothing, so the split stays
    assert s.even["split"] == [4, 4, 4, 4] and s.uneven["split"] == [5, 5, 3, 3]
    assert s.flags() == ["--batch-split", "5,5,3,3"]
    # the even step is paced by a slow rank on 4 samples, the split one by a slow rank on 3:
    # compute 4 : 3 (FLOPs / rate: nothing else differs between the two types)
    assert s.even["slowest"] == s.uneven["slowest"] == "slow"
    assert s.even["compute_s"] == pytest.approx(4 / 3 * s.uneven["compute_s"], rel=1e-9)
    assert s.uneven["compute_s"] == pytest.approx(_compute(mc, s, "slow"), rel=1e-12)
    # less than 4 / 3 overall: the step's communication and optimizer do not shrink
    assert s.uneven["step_s"] < s.even["step_s"] and 1.0 < s.gain < 4 / 3
    # memory per type at its own share: the fast ranks hold 5 samples' activations
    assert s.uneven["memory"]["fast"] > s.even["memory"]["fast"]


def _compute(mc, s, name):
    """compute_s of the `name` type's rank in the split prediction (by its share)."""
    from pyfast.plan.timing import predict_time
    i = [g.name for g in mc.groups].index(name)
    b = s.uneven["split"][[mc.group_of(r) for r in range(4)].index(i)]
    shape = shapes.resolve("gpt-small", None)
    return predict_time(shape, s.plan.replace(micro_batch=b), WORK, mc.for_job(i))["compute_s"]


def test_datasheet_a100_l40s_split_favours_the_faster(tmp_path):
    mc = C.build(cluster_file=write(tmp_path, nodes((2, 1, '"a100-80gb"', ""),
                                                    (2, 1, '"l40s"', ""))))
    pr = _Pricer(shapes.resolve("gpt-small", None), Workload(1024, 64, "bf16"), mc)
    u = uneven_split(pr, Plan(dp=4, micro_batch=16))
    # A100 312 TFLOP/s x 0.595 (fitted) against L40S 362 x 0.45 (assumed): 1.14x the rate
    assert sum(u["split"]) == 64 and min(u["split"][:2]) > max(u["split"][2:])
    assert u["step_s"] < _prediction(pr, {0: Plan(dp=4, micro_batch=16),
                                          1: Plan(dp=4, micro_batch=16)}, None)["step_s"]


def test_pipeline_stages_weighted_by_speed(tmp_path):
    mc = _two_nodes(tmp_path)
    pr = _Pricer(shapes.resolve("gpt-small", None), WORK, mc)
    even, weighted = pipeline(pr, Plan(dp=1, tp=2, pp=2, micro_batch=4, micro_batches=4))
    # stage 0 on the fast node, stage 1 on the slow one: 2x the block's seconds
    assert weighted["pp_balance"] == [1.0, 2.0]
    # gpt-small's 6 blocks: even 3 + 3; weighted by params x cost, the slow stage holds fewer
    assert even["layers"] == [3, 3] and weighted["layers"][1] < 3
    assert weighted["step_s"] < even["step_s"] and even["slowest"] == "slow"
    # interleaved schedules stay even
    assert pipeline(pr, Plan(dp=1, tp=2, pp=2, micro_batch=4, micro_batches=4,
                             schedule="interleaved-1f1b"))[1] is None


def _two_nodes(tmp_path):
    """1 node of 2 fast GPUs + 1 node of 2 slow ones."""
    return C.build(cluster_file=write(tmp_path, nodes((1, 2, FAST, ""), (1, 2, SLOW, "")),
                                      "two.toml"))


@pytest.fixture(scope="module")
def two_nodes_plans(tmp_path_factory):
    """Every plan on the two nodes (one search, shared): (cluster, --json, the text)."""
    import io
    from rich.console import Console
    from pyfast.plan.render_mixed import as_json, render
    mc = _two_nodes(tmp_path_factory.mktemp("two"))
    shape = shapes.resolve("gpt-small", None)
    work = Workload(256, 8, "bf16")  # (fewer micro-batch sizes than WORK: ~2 CPU s here)
    res = search_mixed(shape, work, mc, top=10 ** 6, distinct=False)
    text = io.StringIO()
    render(res, shape, work, mc, Console(file=text, width=250))
    return mc, res, as_json(res, shape, work, mc), text.getvalue()


def test_tp_cp_and_stages_never_span_gpu_types(two_nodes_plans):
    mc, res, _, _ = two_nodes_plans
    assert "span GPU types" in placement_problem(mc, 1, 1, 4, 1, cross_node=True)
    assert "span GPU types" in placement_problem(mc, 1, 2, 2, 1, cross_node=True)
    assert "cross nodes" in placement_problem(mc, 1, 1, 4, 1) or \
        "span GPU types" in placement_problem(mc, 1, 1, 4, 1)
    assert res.mesh_problems[(1, 1, 4, 1)]
    meshes = {(s.plan.dp, s.plan.cp, s.plan.tp, s.plan.pp) for s in res.plans}
    assert {(2, 1, 2, 1), (1, 1, 2, 2), (4, 1, 1, 1), (2, 1, 1, 2)} <= meshes
    for s in res.plans:
        p = s.plan
        for first in range(0, mc.gpus, p.tp * p.cp):  # every tp x cp group: one type
            assert len({mc.group_of(r) for r in range(first, first + p.tp * p.cp)}) == 1
        if p.pp > 1:
            d = p.dp * p.cp * p.tp
            for st in range(p.pp):
                assert len({mc.group_of(r) for r in range(st * d, (st + 1) * d)}) == 1


def test_mixed_plans_pass_the_jobs_checks(two_nodes_plans):
    """The first plan of each kind (split by speed, weighted stages, even): its command's
    flags parse with `pyfast train`'s parser and pass config.check."""
    import shlex
    from pyfast.train import config as T
    _, _, d, _ = two_nodes_plans
    seen = {}
    for row in d["plans"]:
        argv = shlex.split(row["command"])[2:]
        kind = next((f for f in ("--batch-split", "--pp-balance") if f in argv), "even")
        seen.setdefault(kind, argv)
    assert set(seen) == {"--batch-split", "--pp-balance", "even"}
    for argv in seen.values():
        argv = argv[:argv.index("--nproc")]  # the launcher's flags: launch.py checks them
        cfg = T.from_args(T.parser().parse_args(argv))
        T.check(cfg, cfg.ranks, model=False)


def test_json_and_text_carry_the_split(two_nodes_plans):
    _, _, d, text = two_nodes_plans
    assert [g["name"] for g in d["cluster"]["groups"]] == ["fast", "slow"]
    dp = next(r for r in d["plans"] if r["uneven"] and r["pp"] == 1)
    assert dp["batch_split"] == dp["uneven_split"]["split"] and dp["gain"] > 1.0
    assert dp["even"]["split"] == [8 // dp["dp"]] * dp["dp"]
    assert "--batch-split " + ",".join(map(str, dp["batch_split"])) in dp["command"]
    pp = next(r for r in d["plans"] if r["uneven"] and r["pp"] == 2)
    assert pp["pp_balance"] == [1.0, 2.0] and "--pp-balance 1,2" in pp["command"]
    assert "even step s" in text and "sets the pace" in text and "pyfast train" in text


def test_bench_throttle_hook_parses_and_refuses_bad_values():
    """PYFAST_THROTTLE (benchmarks only): parsed per rank; no cap is set here (the rank given
    is not this one: capping the test process would slow the suite)."""
    from pyfast.train.run import bench_throttle
    assert bench_throttle("", rank=0) is None
    assert bench_throttle("1:0.5", rank=0) is None and bench_throttle("2:0.5,3:1", rank=0) is None
    for bad in ("1", "a:0.5", "1:half", "1:0.5,2"):
        with pytest.raises(ValueError, match="RANK:SHARE"):
            bench_throttle(bad, rank=0)
