"""Sample-weighted data parallel (DataParallel / zero(samples=n), pyfast.comm.weights) and the
job's --batch-split: ranks with different batch sizes give the one-process gradient of the
concatenated batch.

Model: a gpt-tiny-shaped GPT with tied embeddings and sizes no block divides (hidden 42, qkv
126, mlp 168, vocab 61, 46K parameters); 16 tokens a row; rank r takes the contiguous rows
[sum(n_0..n_{r-1}), +n_r) of one global batch; its loss is the mean over its own rows.

Tolerances. PRE: the weighted buckets before the reduction, summed over the ranks (/W for the
averaged ones), against the one-process gradient: both are fp32 means over 16-80 rows of 16
tokens (sums of up to ~1300 terms per element) taken in another order, a relative difference of
a few 1e-7; rtol 1e-5 with atol 1e-7 (gradients here are 1e-4..1) is 10x that and 1e3 below
one rank's share (3/4 vs 1/4 weights differ by 0.5 of the gradient). Parameters after 3 AdamW
steps: test_zero's argument (its docstring): AdamW turns a gradient error d into an update
error of about lr * d / |g|, so an element is held to ATOL (1e-6) + steps * lr * GRAD_NOISE /
min|g| over the steps (at most 2 * lr * steps, what AdamW can move it): 1.3e-6 where |g| >=
1e-2, 2e-5 at |g| = 1e-4 (a missed or doubled gradient moves an element by ~lr = 1e-2: 500x
that), loose only for the attention key weights whose gradients sit near 1e-8 (softmax
invariance). 3 ranks, seen: 3.9e-6 at |g| = 1.6e-4. Lossy compressors, step 0 (memory empty): the result is the
average of each rank's decoded (weighted) bucket, so its error against the reference is at most
the per-rank coding error averaged: int8 (absmax blocks, round to nearest) half a step,
max|x_r| / 254 per element, asserted as sum_r max|x_r| / (127 W) (2x); fp16 2^-11 relative per
element (asserted at 2^-10 plus 1e-7 for values below fp16's normal range), bf16 2^-8 (2^-7).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_zero import ATOL, LR, STEPS, WD

SHAPE, V, T = "gpt:layers=2,heads=3,hidden=42", 61, 16
PRE_RTOL, PRE_ATOL = 1e-5, 1e-7
# a gradient element's absolute noise from step 1 on: the parameters then differ by ~1e-7
# (rounding), which moves the next gradients by ~1e-5 of the largest (~1e-2)
GRAD_NOISE = 1e-7


@pytest.fixture(scope="module")
def pool3():
    from dist_utils import RankPool
    with RankPool(3) as pool:
        yield pool


def _model():
    from pyfast.models import build
    torch.manual_seed(0)
    return build(SHAPE, V, T, tie_embeddings=True)


def _batch(total: int, step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (total, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _rows(split, rank) -> slice:
    a = sum(split[:rank])
    return slice(a, a + split[rank])


def _loss(m, x, y):
    return F.cross_entropy(m(x).reshape(-1, V), y.reshape(-1))


def _reference(split, steps=STEPS):
    """One process on the concatenated batch: step 0's gradients, the parameters after
    `steps` AdamW steps and where the gradient sat at its noise level (test_zero)."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    gmin = {k: torch.full(p.shape, float("inf")) for k, p in m.named_parameters()}
    grad0 = None
    for s in range(steps):
        _loss(m, *_batch(sum(split), s)).backward()
        for k, p in m.named_parameters():  # exact zeros (rows no token used) stay exact
            gmin[k] = torch.minimum(gmin[k], p.grad.abs().masked_fill(p.grad == 0, float("inf")))
        if grad0 is None:
            grad0 = {k: p.grad.clone() for k, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
    return grad0, {k: p.detach().clone() for k, p in m.named_parameters()}, gmin


def _close(a, b, gmin, what):
    """Parameters after STEPS AdamW steps (module docstring's bound)."""
    bound = (ATOL + STEPS * LR * GRAD_NOISE / gmin).clamp(max=2 * LR * STEPS)
    bad = (a - b).abs() > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{a.numel()} elements off, largest "
                           f"{float((a - b).abs().max()):.3g}")


def _record(dp, into: dict):
    """Wrap dp.reduce_async: each bucket's parameters as they go into the reduction (weighted),
    and whether it is summed or averaged."""
    inner = dp.reduce_async

    def rec(bucket, c=None, op="avg"):
        if not into:
            into["op"] = op
        for n, v in zip(bucket.names, bucket.views):
            into[n] = v.detach().clone()
        return inner(bucket, c, op)
    dp.reduce_async = rec


def _train_dp(rank, split, steps, opts: dict, accumulate: bool = False):
    """DataParallel(samples=n) on rank's rows of each step: step 0's weighted buckets and
    reduced gradients, and the parameters after `steps` steps."""
    from pyfast.parallel import DataParallel
    dp = DataParallel(_model(), samples=split[rank], **opts)
    opt = torch.optim.AdamW(dp.parameters(), lr=LR, weight_decay=WD)
    pre, grad0 = {}, None
    _record(dp, pre)
    for s in range(steps):
        x, y = (t[_rows(split, rank)] for t in _batch(sum(split), s))
        n = len(x)
        if accumulate and n > 1:  # two micro-batches, each loss weighted by its share of n
            k = n // 2
            with dp.no_sync():
                (_loss(dp, x[:k], y[:k]) * (k / n)).backward()
            (_loss(dp, x[k:], y[k:]) * ((n - k) / n)).backward()
        else:
            _loss(dp, x, y).backward()
        if grad0 is None:
            grad0 = {k: p.grad.clone() for k, p in dp.module.named_parameters()}
            dp.reduce_async = type(dp).reduce_async.__get__(dp)
        opt.step()
        opt.zero_grad()
    dp.close()
    return dict(pre=pre, grad0=grad0,
                params={k: p.detach().clone() for k, p in dp.module.named_parameters()})


# name -> (DataParallel options, how step 0's result is checked: "exact" (and the parameters
# after 3 steps), a coding bound, or "pre" (the weighted input only: 1-bit, sparse, low-rank
# and auto's results have no per-element bound; they must still agree on every rank))
DP_CASES = {
    "none": (dict(compressor="none"), "exact"),
    "none-views": (dict(compressor="none", gradient_as_bucket_view=True), "exact"),
    "none-accumulate": (dict(compressor="none"), "exact"),
    "fp16": (dict(compressor="fp16", engine="python"), ("cast", 2 ** -10)),
    "bf16-native": (dict(compressor="bf16", engine="native"), ("cast", 2 ** -7)),
    "int8-native": (dict(compressor="int8", engine="native"), ("block", 127)),
    "int8-python": (dict(compressor="int8", engine="python", check_finite="raise"),
                    ("block", 127)),
    "int4": (dict(compressor="int4"), "pre"),
    "fp8": (dict(compressor="fp8"), "pre"),
    "sign": (dict(compressor="sign"), "pre"),
    "topk": (dict(compressor="topk:0.1"), "pre"),
    "powersgd": (dict(compressor="powersgd:2"), "pre"),
    "auto": (dict(compressor="auto"), "pre"),
}
DP3_CASES = ("none", "int8-native")


def _dp_cases(rank, world, split, names):
    out = {}
    for name in names:
        opts, how = DP_CASES[name]
        out[name] = _train_dp(rank, split, STEPS if how == "exact" else 1, opts,
                              accumulate=name.endswith("accumulate"))
    return out


def _check_dp(results, split, names):
    world = len(split)
    grad0, ref, noisy = _reference(split)
    for name in names:
        how = DP_CASES[name][1]
        per = [r[name] for r in results]
        for r in range(1, world):  # replicas agree bit for bit
            for k, g in per[0]["grad0"].items():
                assert torch.equal(g, per[r]["grad0"][k]), (name, r, k)
        summed = per[0]["pre"]["op"] == "sum"
        for k, g in grad0.items():
            pre = sum(p["pre"][k] for p in per) / (1 if summed else world)
            torch.testing.assert_close(pre, g, rtol=PRE_RTOL, atol=PRE_ATOL,
                                       msg=lambda m: f"{name} {k} weighted input: {m}")
            got = per[0]["grad0"][k]
            assert torch.isfinite(got).all(), (name, k)
            if how == "exact":
                torch.testing.assert_close(got, g, rtol=PRE_RTOL, atol=PRE_ATOL,
                                           msg=lambda m: f"{name} {k} gradient: {m}")
            elif how != "pre":
                kind, f = how
                if kind == "block":
                    bound = sum(p["pre"][k].abs().max() for p in per) / (f * world)
                else:
                    bound = sum(p["pre"][k].abs() for p in per) * f / world + 1e-7
                err = (got - g).abs()
                assert (err <= bound * 1.001 + 1e-7).all(), \
                    f"{name} {k}: error {float(err.max()):.3g} above the {kind} bound"
        if how == "exact":
            for k, v in per[0]["params"].items():
                _close(v, ref[k], noisy[k], f"{name} {k} after {STEPS} steps vs one process")


def test_uneven_batches_give_the_concatenated_gradient_2_ranks(pool2):
    names = list(DP_CASES)
    _check_dp(pool2.run(_dp_cases, [3, 1], names), [3, 1], names)


def test_uneven_batches_give_the_concatenated_gradient_3_ranks(pool3):
    _check_dp(pool3.run(_dp_cases, [5, 2, 1], DP3_CASES), [5, 2, 1], DP3_CASES)


def _bad_samples(rank, world):
    """n = 0 on rank 1: every rank raises the same ValueError after the step's reductions (no
    hang) and the next step, given n >= 1, runs; a non-integer is refused where it is set."""
    from pyfast.parallel import DataParallel
    out = {}
    for engine, comp in (("native", "none"), ("python", "int8")):
        dp = DataParallel(_model(), compressor=comp, engine=engine, samples=[3, 0][rank])
        x, y = _batch(4, 0)
        try:
            _loss(dp, x[:2], y[:2]).backward()
        except ValueError as e:
            out[engine] = str(e)
        dp.samples = 1
        _loss(dp, x[:2], y[:2]).backward()  # usable again
        out[engine + " after"] = bool(torch.isfinite(dp.module[0].tok.weight.grad).all())
        dp.close()
    from pyfast.parallel import zero
    model, opt = zero(_model(), torch.optim.AdamW, stage=2, samples=[3, 0][rank])
    try:
        _loss(model, x[:2], y[:2]).backward()
    except ValueError as e:
        out["zero"] = str(e)
    model.close()
    from pyfast.parallel.ft import FTError
    for make in (lambda: DataParallel(_model(), replicas=object(), samples=1),
                 lambda: zero(_model(), torch.optim.AdamW, replicas=object(), samples=1)):
        try:  # refused before any collective or use of the replicas
            make()
        except FTError as e:
            out.setdefault("ft", []).append(str(e))
    for bad in (2.5, True, "3"):
        try:
            dp.samples = bad
        except TypeError as e:
            out[repr(bad)] = str(e)
    return out


def test_bad_samples_raise_on_every_rank(pool2):
    for r in pool2.run(_bad_samples):
        for engine in ("native", "python"):
            assert "samples must be >= 1 on every rank; got [3, 0] (rank(s) 1: 0)" in r[engine]
            assert r[engine + " after"]
        assert "zero: samples must be >= 1 on every rank; got [3, 0]" in r["zero"]
        assert len(r["ft"]) == 2 and all("samples=...): not supported under torchft" in m
                                         for m in r["ft"])
        assert "samples must be an int" in r["2.5"] and "float 2.5" in r["2.5"]
        assert "got True" in r["True"] and "str '3'" in r["'3'"]


def _rank_grads(split, step=0):
    """One process: each rank's weighted gradient n_r * W / N * grad(mean loss of its rows),
    what it puts into the reduction (for the coding bounds of zero's lossy reduce-scatter)."""
    m, world, total = _model(), len(split), sum(split)
    x, y = _batch(total, step)
    out = []
    for r in range(world):
        m.zero_grad()
        _loss(m, x[_rows(split, r)], y[_rows(split, r)]).backward()
        out.append({k: p.grad * (split[r] * world / total) for k, p in m.named_parameters()})
    return out


def _train_zero(rank, split, steps, stage, compressor=None, hybrid=False):
    """zero(samples=n): step 0's master gradient shards ({name: (start, shard)}) and the full
    parameters after `steps` steps."""
    from pyfast.parallel import zero
    groups = {}
    if hybrid:
        from test_zero_hybrid import _groups
        groups = dict(zip(("group", "replica_group"), _groups()))
    model, opt = zero(_model(), torch.optim.AdamW, stage=stage, compressor=compressor, lr=LR,
                      weight_decay=WD, samples=split[rank], **groups)
    names = {id(p): k for k, p in model.module.named_parameters()}
    shards = None
    for s in range(steps):
        x, y = (t[_rows(split, rank)] for t in _batch(sum(split), s))
        _loss(model, x, y).backward()
        opt.reduce_gradients()  # stage 1 reduces here
        if shards is None:
            shards = {}
            for p in model._params:
                u, i = model.layout.of(p)
                sh = u.shards[i]
                shards[names[id(p)]] = (sh.start, model.master(p).grad.clone())
        opt.step()
        opt.zero_grad()
    if model.stage == 3:
        model.gather_all()
    params = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    model.close()
    return dict(shards=shards, params=params)


ZERO_CASES = {"z2-none": (2, None), "z2-int8": (2, "int8"), "z1-none": (1, None),
              "z3-none": (3, None)}


def _zero_cases(rank, world, split, names, hybrid=False):
    return {name: _train_zero(rank, split, STEPS if ZERO_CASES[name][1] is None else 1,
                              *ZERO_CASES[name], hybrid=hybrid) for name in names}


def _check_zero(results, split, names):
    grad0, ref, gmin = _reference(split)
    pre = _rank_grads(split)
    world = len(split)
    for name in names:
        for r, res in enumerate(results):
            for k, (start, got) in res[name]["shards"].items():
                want = grad0[k].reshape(-1)[start:start + got.numel()]
                if ZERO_CASES[name][1] is None:
                    torch.testing.assert_close(got, want, rtol=PRE_RTOL, atol=PRE_ATOL,
                                               msg=lambda m: f"{name} rank {r} {k}: {m}")
                else:  # int8's bound (module docstring), per shard
                    bound = sum(p[k].abs().max() for p in pre) / (127 * world)
                    err = float((got - want).abs().max())
                    assert err <= bound * 1.001 + 1e-7, (name, r, k, err, float(bound))
        if ZERO_CASES[name][1] is None:
            for k, v in results[0][name]["params"].items():
                _close(v, ref[k], gmin[k], f"{name} {k} after {STEPS} steps vs one process")
                for r in range(1, world):
                    assert torch.equal(v, results[r][name]["params"][k]), (name, r, k)


def test_zero_uneven_batches_give_the_concatenated_gradient(pool2):
    names = list(ZERO_CASES)
    _check_zero(pool2.run(_zero_cases, [3, 1], names), [3, 1], names)


def test_zero_hybrid_uneven_batches(pool4):
    """Hybrid sharding (shard groups {0,1} {2,3}, replicas {0,2} {1,3}): the weight spans both."""
    split, names = [4, 1, 2, 1], ["z2-none"]
    _check_zero(pool4.run(_zero_cases, split, names, hybrid=True), split, names)


# the job's parameters after 3 steps against the even split's (lr 1e-3 after a 1-step warm-up):
# the same gradient reduced another way, so test_zero's AdamW argument (module docstring):
# 1.73e-6 seen at most (DataParallel and --zero 2), 6x below; a rank's gradient weighted 1/2
# instead of 3/4 moves the first step's update by ~lr = 1e-3. Logged losses: 7e-8 relative seen.
PARAM_TOL = 1e-5
JOB = dict(model="gpt-tiny", dp=2, steps=3, batch=4, seq=32, seed=1, tensorboard="off",
           warmup=1)


def _job_run(rank, world, flags: dict):
    """The job's steps (pyfast.train.job.Job.train_step, as `pyfast train` runs them) on this
    rank: each step's record, the parameters after them and the first batch's rows."""
    from pyfast.train.config import TrainConfig, check
    from pyfast.train.job import Job
    cfg = TrainConfig(**{**JOB, **flags})
    check(cfg, world)
    job = Job(cfg, torch.device("cpu"))  # cpu-literal: the test's ranks
    x, _ = job.batches.next()
    job.batches.position = 0
    recs = [job.train_step(s) for s in range(cfg.steps)]
    params = {k: p.detach().clone() for k, p in job.model.named_parameters()}
    val = job.evaluate()
    (job.dp or job.zero).close()
    return dict(recs=recs, params=params, rows=x, val=val)


def test_job_batch_split_equals_the_even_split(pool2):
    """--batch-split 3,1 against the even split of the same global batches (2 ranks, gpt-tiny,
    3 steps, int8 and --zero 2 too): the same rows in the same order, the same logged loss (the
    global batch's mean, to fp32 rounding: 1e-6 relative), `batch_split` in each record, the
    parameters within test_zero's AdamW bound (here against a run whose gradient is the same
    mean reduced another way), and the validation loss of the same rows."""
    runs = {name: pool2.run(_job_run, flags) for name, flags in (
        ("even", {}), ("split", {"batch_split": "3,1"}),
        ("zero-split", {"zero": 2, "batch_split": "3,1"}))}
    even, split = runs["even"], runs["split"]
    rows = torch.cat([r["rows"] for r in even])
    assert [len(r["rows"]) for r in split] == [3, 1]
    assert torch.equal(torch.cat([r["rows"] for r in split]), rows)  # the same data order
    for name in ("split", "zero-split"):
        for s in range(JOB["steps"]):
            rec, ref = runs[name][0]["recs"][s], even[0]["recs"][s]
            assert rec["batch_split"] == [3, 1] and "batch_split" not in ref
            assert abs(rec["loss"] - ref["loss"]) <= 1e-6 * ref["loss"], (name, s, rec, ref)
            assert rec["tokens_per_s"] > 0
        assert abs(runs[name][0]["val"] - even[0]["val"]) <= 1e-6 * even[0]["val"]
        for k, v in runs[name][0]["params"].items():
            err = float((v - even[0]["params"][k]).abs().max())
            assert err <= PARAM_TOL, (name, k, err)
            assert torch.equal(v, runs[name][1]["params"][k]), (name, k)  # replicas bit-equal


@pytest.mark.parametrize("flags, message", [
    (dict(batch_split="3,2"), "--batch-split 3,2 sums to 5, but --batch is 4"),
    (dict(batch_split="4"), "--batch-split 4: 1 number(s) for --dp 2"),
    (dict(batch_split="4,0"), "every dp rank needs at least one sample (rank 1: 0)"),
    (dict(batch_split="5,-1"), "(rank 1: -1)"),
    (dict(batch_split="3,x"), "--batch-split '3,x': comma-separated integers"),
    (dict(batch_split="3,1", grad_accum=2), "= 2 equal pieces, so every number must be a "
     "multiple of 2; not: rank 0: 3, rank 1: 1"),
    (dict(batch_split="6,2", batch=8, micro_batches=4), "--micro-batches 4 = 4 equal pieces"),
    (dict(batch_split="3,1", pp=2, dp=1), "--batch-split 3,1 with --pp"),
    (dict(batch_split="3,1", cp=2), "with --cp"),
    (dict(batch_split="3,1", diloco=4, replicas=2, batch=8), "with --diloco"),
    # auto: the same refusals (its own checks: tests/test_batch_split_auto.py)
    (dict(batch_split="auto", pp=2, dp=1), "--batch-split auto with --pp"),
])
def test_bad_batch_split_flags(flags, message):
    from pyfast.train.config import ConfigError, TrainConfig, check
    cfg = TrainConfig(**{**JOB, **flags})
    with pytest.raises(ConfigError) as e:
        check(cfg, cfg.ranks, model=False)
    assert message in str(e.value)


def test_batches_split_keeps_the_global_batches():
    """Batches(split=): rank r's rows are the contiguous slice of the even run's global batch,
    across an epoch boundary too; a split that does not fit raises naming it."""
    import numpy as np

    from pyfast.data import Batches
    tokens = np.arange(33 * 12 + 1, dtype=np.uint16)  # 12 sequences: 2 global batches of 5
    whole = Batches(tokens, 5, 33, seed=3)
    parts = [Batches(tokens, 5, 33, seed=3, dp_rank=r, dp_size=3, split=[1, 3, 1])
             for r in range(3)]
    for _ in range(5):  # past the end of the first epoch
        x, y = whole.next()
        got = [b.next() for b in parts]
        assert [len(g[0]) for g in got] == [1, 3, 1]
        assert torch.equal(torch.cat([g[0] for g in got]), x)
        assert torch.equal(torch.cat([g[1] for g in got]), y)
    for b in parts:  # a new split from the next global batch on (a re-balanced run)
        b.resplit([2, 1, 2])
    x, _ = whole.next()
    assert torch.equal(torch.cat([b.next()[0] for b in parts]), x)
    for bad in ([2, 2, 2], [5, 0, 0], [4, 1]):
        with pytest.raises(ValueError, match="split .* must give each of dp_size 3 ranks"):
            Batches(tokens, 5, 33, seed=3, dp_rank=0, dp_size=3, split=bad)


def test_dry_run_runs_the_split():
    """The dry run (meta tensors, fake group) runs --batch-split: rank 0's 3 rows hold more
    activations than rank 1's one."""
    from pyfast.train.config import TrainConfig
    from pyfast.train.dryrun import dry_run
    rows = dry_run(TrainConfig(model="gpt-tiny", dp=2, batch=4, seq=32, batch_split="3,1"), 2,
                   [0, 1])
    assert rows[0]["peak_bytes"] > rows[1]["peak_bytes"] > 0


def _even(rank, world):
    """The even split given as samples=2 on both ranks against samples=None: the weight is
    exactly 1 (n * W / N = 2 * 2 / 4; n / N = 1/2 for the summed buckets, what None scales by),
    so the parameters are bit-identical, and None sends no samples vector at all."""
    from pyfast.parallel import DataParallel
    out = {}
    for comp, engine in (("none", "native"), ("int8", "native"), ("int8", "python")):
        for samples in (None, 2):
            dp = DataParallel(_model(), compressor=comp, engine=engine, samples=samples)
            opt = torch.optim.AdamW(dp.parameters(), lr=LR)
            for s in range(2):
                x, y = (t[2 * rank:2 * rank + 2] for t in _batch(4, s))
                _loss(dp, x, y).backward()
                if samples is None:
                    assert not dp._weights.active and dp._weights._vec is None
                opt.step()
                opt.zero_grad()
            dp.close()
            out[(comp, engine, samples)] = [p.detach().clone() for p in dp.parameters()]
    return out


def test_even_samples_are_bit_identical_to_none(pool2):
    for r in pool2.run(_even):
        for comp, engine in (("none", "native"), ("int8", "native"), ("int8", "python")):
            a, b = r[(comp, engine, None)], r[(comp, engine, 2)]
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (comp, engine)
