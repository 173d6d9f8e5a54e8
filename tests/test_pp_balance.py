"""Speed-weighted pipeline stages (issue 36): pyfast._partition.partition with per-stage costs
and memory capacities against brute force over every cut of small cases; costs=None against
the partition as it was before costs existed (bit for bit); Pipeline.from_sequential(
stage_costs=...) with uneven stages on a 4-block GPT against the dense model (loss and every
gradient within 5e-6 of the largest: fp32, micro-batches only regroup the sums); bad
stage_costs failing on every rank; and `pyfast train --pp-balance` once, against one process."""
import itertools
import math
import random
import re

import pytest
import torch
import torch.nn.functional as F

from pyfast._partition import partition, stage_time


def old_partition(weights, n_stages):
    """pyfast._partition.partition before costs (a49026f), the reference for costs=None."""
    n = len(weights)
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)
    worst = (float("inf"), n)
    best = [[worst] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                c = max(best[k - 1][j], (pre[i] - pre[j], i - j))
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    counts, i = [], n
    for k in range(n_stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def cuts(n, k):
    """Every way to cut n layers into k non-empty contiguous stages (layer counts)."""
    for bars in itertools.combinations(range(1, n), k - 1):
        edges = (0, *bars, n)
        yield [edges[i + 1] - edges[i] for i in range(k)]


def test_costs_by_hand():
    # 8 equal layers, rank 1 half as fast: 5 + 3 (times 5 and 6) beats 6 + 2 (6 and 4) on the tie
    # at 6 by its more even layer counts; even speeds: 4 + 4
    assert partition([1] * 8, 2, [1, 2]) == [5, 3]
    assert partition([1] * 8, 2) == [4, 4] == partition([1] * 8, 2, [1, 1])
    # the slow middle rank gets 2 of 9 (4, 2, 3 ties at 4; the scan keeps the first it meets)
    assert partition([1] * 9, 3, [1, 2, 1]) == [3, 2, 4]
    # gpt-tiny with 4 blocks by parameters (embed, 4 blocks, head): rank 1 three times slower
    # holds one block and the head
    assert partition([6208, 49984, 49984, 49984, 49984, 6336], 2, [1, 3]) == [4, 2]


def test_costs_none_is_the_old_partition_bit_for_bit():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        k = rng.randint(1, n)
        w = [rng.choice([rng.randint(0, 9), rng.random() * 1e6]) for _ in range(n)]
        assert partition(w, k) == old_partition(w, k), (w, k)


def test_brute_force_optimum_with_costs_and_capacity():
    rng = random.Random(1)
    for case in range(400):
        n = rng.randint(1, 8)
        k = rng.randint(1, min(n, 4))
        w = [rng.choice([1, 2, rng.random() * 10]) for _ in range(n)]
        costs = [rng.choice([1.0, 2.0, 0.5 + rng.random() * 3]) for _ in range(k)]
        mem = cap = None
        if case % 2:  # capacities: some cuts (or all) do not fit
            mem = [rng.randint(1, 5) for _ in range(n)]
            cap = [rng.randint(2, 12) for _ in range(k)]
        fits = [c for c in cuts(n, k) if mem is None or all(
            sum(mem[sum(c[:s]):sum(c[:s + 1])]) <= cap[s] for s in range(k))]
        if not fits:
            with pytest.raises(ValueError, match="fits the capacities"):
                partition(w, k, costs, mem, cap)
            continue
        got = partition(w, k, costs, mem, cap)
        assert got in fits, (w, k, costs, got)
        best = min(stage_time(w, c, costs) for c in fits)
        assert math.isclose(stage_time(w, got, costs), best, rel_tol=1e-12), (w, costs, got)


@pytest.mark.parametrize("costs,message", [
    ([1.0], "has 1 entries for 2 stages"), ([1.0, 0.0], "finite and > 0"),
    ([1.0, -2.0], "finite and > 0"), ([1.0, float("nan")], "finite and > 0"),
    ([float("inf"), 1.0], "finite and > 0"), (["fast", 1.0], "must be 2 numbers"),
])
def test_bad_costs(costs, message):
    with pytest.raises(ValueError, match=message):
        partition([1, 2, 3], 2, costs)


# -- on two ranks -------------------------------------------------------------------------------
def gpt():
    from pyfast import models
    torch.manual_seed(0)  # embed, 4 blocks (LayerNorm, biases, odd head size 97), head
    return models.build("gpt:layers=4,heads=4,hidden=64", 97, 24)


def _loss(y, t):
    return F.cross_entropy(y.flatten(0, 1), t.flatten())


def uneven_against_dense(rank, world):
    """Per case: the layer counts, and the worst relative difference of loss and gradients
    from the dense model; bad cases: the message each rank raised."""
    from pyfast.parallel import Pipeline, stage_costs
    out = {}
    g = torch.Generator().manual_seed(3)
    x, t = torch.randint(0, 97, (6, 24), generator=g), torch.randint(0, 97, (6, 24), generator=g)
    ref = gpt()
    ref_loss = _loss(ref(x), t)
    ref_loss.backward()
    want = dict(ref.named_parameters())
    stage_costs.PROBE_S = 0.05  # the probe's length only sets its precision; a test needs none
    nbytes = [sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
              for m in ref]
    for name, kw in {"1f1b costs 1,3": dict(schedule="1f1b", stage_costs=[1, 3]),
                     # rank 0's budget fits embed + 2 blocks: the cut 4,2 the costs want no more
                     "1f1b costs 1,3, memory": dict(schedule="1f1b", stage_costs=[1, 3],
                                                    stage_memory=[sum(nbytes[:3]), 1e12]),
                     "gpipe costs 3,1": dict(schedule="gpipe", stage_costs=[3.0, 1.0]),
                     "1f1b measure": dict(schedule="1f1b", stage_costs="measure")}.items():
        pipe = Pipeline.from_sequential(gpt(), 3, kw.pop("schedule"), _loss, **kw)
        loss = pipe.step(x if rank == 0 else None, t if rank == 1 else None)
        worst = 0.0 if loss is None else abs(loss.item() - ref_loss.item()) / ref_loss.item()
        for stage in pipe.stages.values():
            for n, p in stage.named_parameters():
                r = want[n].grad
                worst = max(worst, ((p.grad - r).abs().max() / r.abs().max()).item())
        out[name] = ([pipe.bounds[s + 1] - pipe.bounds[s] for s in range(pipe.n_stages)],
                     worst, pipe.stage_costs)
    for name, kw in {"length": dict(stage_costs=[1.0]),
                     "zero": dict(stage_costs=[1.0, 0.0]),
                     "nan": dict(stage_costs=[float("nan"), 1.0]),
                     "list": dict(stage_costs=[1, 2], balance=[3, 3]),
                     "word": dict(stage_costs="fast"),
                     "memory length": dict(stage_memory=[1e9]),
                     "memory fits nowhere": dict(stage_memory=[1e5, 1e5])}.items():
        try:
            Pipeline.from_sequential(gpt(), 2, "1f1b", _loss, **kw)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.mark.dist
def test_uneven_stages_equal_the_dense_model_and_bad_costs_fail_everywhere(pool2):
    res = pool2.run(uneven_against_dense, timeout=120)
    for rank, got in enumerate(res):
        # fp32: the pipeline sums each gradient over 3 micro-batches of 2 rows where the dense
        # model sums 6 rows at once: a few ulps of the largest gradient (measured <= 6.9e-7
        # relative to it); 5e-6 leaves room for another BLAS blocking, none for a wrong cut
        assert got["1f1b costs 1,3"][0] == [4, 2] and got["gpipe costs 3,1"][0] == [2, 4], got
        assert got["1f1b costs 1,3, memory"][0] == [3, 3], got
        for name in ("1f1b costs 1,3", "gpipe costs 3,1", "1f1b measure", "1f1b costs 1,3, memory"):
            assert got[name][1] < 5e-6, (rank, name, got[name])
        counts, _, costs = got["1f1b measure"]
        assert sum(counts) == 6 and min(costs) == 1.0 and len(costs) == 2, got
        assert costs == res[0]["1f1b measure"][2] and counts == res[0]["1f1b measure"][0]
        for name, msg in {"length": "has 1 entries for 2 stages.*2 ranks",
                          "zero": "finite and > 0", "nan": "finite and > 0",
                          "list": "a list of layer counts is the cut itself",
                          "word": "one float per pp rank or 'measure'",
                          "memory length": "stage_memory has 1 entries for 2 stages.*byte budget",
                          "memory fits nowhere": "no cut of the 6 layers .* fits the capacities"
                          }.items():
            assert re.search(msg, got[name]), (rank, name, got[name])
        assert got["nan"] == res[0]["nan"]  # the same error on both ranks, not "disagree"


# -- the job ------------------------------------------------------------------------------------
def test_flag_checks():
    from pyfast.train.config import ConfigError, TrainConfig, check
    base = dict(model="gpt-tiny", batch=8, seq=32, steps=1)
    for flags, msg in [(dict(pp_balance="auto"), "needs --pp > 1"),
                       (dict(pp=2, pp_balance="1,2,3"), "3 costs for --pp 2"),
                       (dict(pp=2, pp_balance="1,0"), "finite and > 0"),
                       (dict(pp=2, pp_balance="fast"), "even, auto, or one number")]:
        cfg = TrainConfig(**base, **flags)
        with pytest.raises(ConfigError, match=msg):
            check(cfg, cfg.ranks)


@pytest.mark.dist
def test_job_flag_matches_one_process(tmp_path_factory):
    from test_train import losses, records, rel, shared_runs
    runs = shared_runs(tmp_path_factory, {"1proc": (1, []),
                                          "pp2-balance": (2, ["--pp", "2", "--pp-balance", "1,3"])})
    # fp32: test_train's bar for every mesh (1e-5 relative over the three losses)
    assert rel(losses(runs["pp2-balance"]), losses(runs["1proc"])) < 1e-5
    for r in records(runs["pp2-balance"]):
        assert len(r["pp_idle"]) == 2 and all(0 <= f < 1 for f in r["pp_idle"]), r


def test_trace_idle_fractions_by_hand():
    from pyfast.parallel.trace import idle_fractions
    # rank 0: 1 s forward, 3 s waiting, 1 s backward (span 5 s); rank 1: no wait; rank 2: none
    rank0 = [("forward", "F0", 10.0, 11.0), ("idle", "B0", 11.0, 14.0), ("backward", "B0", 14.0, 15.0)]
    rank1 = [("forward", "F0", 11.0, 12.0), ("send", "F0", 12.0, 12.5)]
    assert idle_fractions([rank0, rank1, []]) == [0.6, 0.0, 0.0]
