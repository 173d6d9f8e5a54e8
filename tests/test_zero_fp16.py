"""fp16 with ZeRO (issue 33, item 4): ZeroGradScaler (pyfast.parallel.zero.scaler) and
`pyfast train --zero S --precision fp16`, against fp16 DataParallel on the same data.

Two launches of the shared 2-rank pool: the job at zero 1/2/3 and DataParallel (the loss-scale
trajectory, the skipped steps, the parameters), and zero() with ZeroGradScaler directly (one
rank overflowing, the feedback memory put back, the bad input). The dry run is in the test
process (fake group).
"""
import math

import pytest
import torch

STEPS = 4
OVERFLOW_AT = 3  # step 1 already overflows at GradScaler's 2^16 (gpt-tiny); 3 is forced


def _job_run(rank, world, zero, compress, steps=STEPS):
    """gpt-tiny at --dp 2 --precision fp16 (--zero `zero`, 0: DataParallel): per step the
    loss scale, skipped flag and loss; rank 1's loss times 1e30 at OVERFLOW_AT (a test-only
    wrap of the job's loss function, as tests/test_train_safety.py). Then the full parameters
    and, with a lossy compressor, whether a skipped step left the feedback memory as it was."""
    from pyfast.parallel.zero import checkpoint as zck
    from pyfast.train.config import TrainConfig
    from pyfast.train.job import Job
    from dist_utils import job_step
    cfg = TrainConfig(model="gpt-tiny", dp=2, precision="fp16", zero=zero, compress=compress,
                      steps=steps, batch=4, seq=16, seed=5, lr=1e-3)
    job = Job(cfg, torch.device("cpu"))
    c = (job.zero or job.dp).compressor
    memory = c.feedback.memory if getattr(c, "feedback", None) is not None else {}
    recs, kept = [], []
    try:
        for step in range(1, steps + 1):
            before = {k: v.clone() for k, v in memory.items()}
            rec = job_step(job, step, overflow=step == OVERFLOW_AT and rank == 1)
            recs.append({k: rec[k] for k in ("loss", "loss_scale", "skipped")})
            if rec["skipped"]:
                kept.append(before.keys() == memory.keys() and all(
                    torch.equal(before[k], memory[k]) for k in before))
        finite = all(bool(torch.isfinite(v).all()) for v in memory.values())
        if job.zero is not None:
            params = zck.full_state_dict(job.zero, job.opt)["model"]
        else:
            params = {k: v.detach().clone() for k, v in job.model.state_dict().items()}
        params = {k.removeprefix("module."): v.float() for k, v in params.items()}
    finally:
        job.close()
    return recs, params, kept, finite


def _job_matrix(rank, world):
    out = {z: _job_run(rank, world, z, "none") for z in (0, 1, 2, 3)}
    out["int8"] = _job_run(rank, world, 2, "int8")
    return out


@pytest.mark.dist
def test_fp16_zero_job_follows_data_parallel(pool2):
    """--zero 1/2/3 --precision fp16 against DataParallel's fp16 on the same batches: the same
    loss scales and skipped steps on both ranks (step 1 overflows at 2^16, step 3 is forced on
    rank 1 only), losses and parameters within fp32 tolerance; with int8 under --zero 2 the
    skipped steps leave every rank's feedback memory bitwise as it was."""
    res = pool2.run(_job_matrix, timeout=400)
    ref = res[0][0][0]
    want = [True, False, True] + [False] * (STEPS - 3)
    assert [r["skipped"] for r in ref] == want
    assert ref[OVERFLOW_AT]["loss_scale"] == ref[OVERFLOW_AT - 1]["loss_scale"] / 2
    for rank in (0, 1):
        recs_dp, p_dp, _, _ = res[rank][0]
        for z in (1, 2, 3, "int8"):
            recs, params, kept, finite = res[rank][z]
            assert [r["skipped"] for r in recs] == want, (rank, z)
            assert [r["loss_scale"] for r in recs] == [r["loss_scale"] for r in recs_dp], z
            if z == "int8":  # lossy: the memory put back at both skips, finite throughout
                assert kept == [True, True] and finite, (rank, kept, finite)
                continue
            # the same fp16 forward/backward on the same batches; the reduction differs in
            # summation order only (reduce-scatter vs all-reduce: fp32 rounding) and AdamW's
            # two updates amplify a rounding difference by at most lr-sized steps: 1e-5
            # absolute on parameters of size ~0.02-1 is fp32 arithmetic, not a lost step
            # (one step of lr 1e-3 moves each parameter by ~1e-3)
            for a, b in zip(recs, recs_dp):
                assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) or \
                    not math.isfinite(b["loss"]), (z, a, b)
            assert p_dp.keys() <= params.keys(), z  # zero's also holds the rotary buffers
            for k in p_dp:
                torch.testing.assert_close(params[k], p_dp[k], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"zero {z} rank {rank} {k}: {m}")


# ------------------------------------------------------------------ zero() with ZeroGradScaler
VOCAB, SEQ = 67, 16  # an odd vocabulary: the tied embedding's shard edges fall mid-row


def _batches(rank, n):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=g) for _ in range(n)]


def _scaled_run(rank, stage, spec, overflow: bool):
    """gpt-tiny under zero(stage, spec) and ZeroGradScaler (CPU autocast fp16), three batches.
    overflow: rank 1's loss at step 2 times 1e30 (rank 0 stays finite); else step 2's batch is
    left out and the scale set to what the skip's back-off gives. Returns the scale and
    found_inf per step, the full parameters, the feedback memory and AdamW's step count."""
    import torch.nn.functional as F

    from pyfast.models import build
    from pyfast.parallel.zero import checkpoint as zck
    from pyfast.parallel.zero import zero
    from pyfast.parallel.zero.scaler import ZeroGradScaler
    torch.manual_seed(0)
    model, opt = zero(build("gpt-tiny", VOCAB, SEQ), torch.optim.AdamW, stage=stage,
                      compressor=spec, lr=1e-2)
    scaler = ZeroGradScaler("cpu", optimizer=opt, init_scale=2.0 ** 8)
    trace = []
    try:
        for step, b in enumerate(_batches(rank, 3), 1):
            if step == 2 and not overflow:
                scaler.update(new_scale=scaler.get_scale() / 2)
                continue
            x, y = b[:, :-1], b[:, 1:]
            with torch.autocast("cpu", torch.float16):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            if step == 2 and rank == 1:
                loss = loss * 1e30
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            trace.append((scale, float(scaler.found_inf(opt))))
            scaler.update()
            opt.zero_grad()
        fb = getattr(model.compressor, "feedback", None)  # "none": no memory
        memory = {k: v.clone() for k, v in fb.memory.items()} if fb is not None else {}
        sd = zck.full_state_dict(model, opt)
        steps = sorted({float(v["step"]) for v in sd["optim"]["state"].values()})
        return trace, sd["model"], memory, steps
    finally:
        model.close()


def _bad_input(rank):
    import torch.nn.functional as F

    from pyfast.models import build
    from pyfast.parallel.zero import zero
    from pyfast.parallel.zero.scaler import ZeroGradScaler
    model, opt = zero(build("gpt-tiny", VOCAB, SEQ), torch.optim.AdamW, stage=2,
                      compressor="int8")
    errors = []
    try:
        try:
            ZeroGradScaler("cpu", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        except TypeError as e:
            errors.append(str(e))
        scaler = ZeroGradScaler("cpu")  # the optimizer not given: its memory is not staged
        x = _batches(rank, 1)[0]
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        scaler.scale(loss).backward()
        try:
            scaler.step(opt)
        except ValueError as e:
            errors.append(str(e))
    finally:
        model.close()
    return errors


CASES = [(1, "none"), (2, "int8"), (3, "int8"), (2, "topk:0.3")]


def _scaler_cases(rank, world):
    out = {c: (_scaled_run(rank, *c, True), _scaled_run(rank, *c, False)) for c in CASES}
    return out, _bad_input(rank)


@pytest.mark.dist
def test_zero_grad_scaler_skips_together_and_leaves_no_trace(pool2):
    """Only rank 1 overflows at step 2; rank 0's own shards are finite (with topk:0.3 rank 1
    sends its units as zeros, so nobody's shards see the Inf: the flag alone carries it), yet
    found_inf is set on both ranks after ZeroGradScaler's one all-reduce, both skip, and the
    scale backs off on both. The skipped step leaves nothing behind: parameters, AdamW state
    and the error-feedback memory after step 3 equal, bitwise, a run that never saw step 2's
    batch (the same scale at step 3; a power-of-2 scale change is exact, and the runs do the
    same operations in the same order, so any difference is a trace of the skip). Stage 1
    checks the reduction before unscale_ (torch's ShardedGradScaler alone finds no gradient
    there and steps the scaled one)."""
    res = pool2.run(_scaler_cases, timeout=300)
    for rank in (0, 1):
        out, errors = res[rank]
        for case in CASES:
            (trace, params, memory, steps), (t_ref, p_ref, m_ref, s_ref) = out[case]
            assert [s for s, _ in trace] == [256.0, 256.0, 128.0], (rank, case, trace)
            assert [f > 0 for _, f in trace] == [False, True, False], (rank, case, trace)
            assert [s for s, _ in t_ref] == [256.0, 128.0], (rank, case)
            assert steps == s_ref == [2.0], (rank, case)  # AdamW stepped twice, not three times
            for k in p_ref:
                assert torch.equal(params[k], p_ref[k]), (rank, case, k)
            assert memory.keys() == m_ref.keys(), (rank, case)
            assert (len(memory) > 0) == (case[1] != "none"), (rank, case)
            for k in m_ref:
                assert torch.equal(memory[k], m_ref[k]), (rank, case, k)
                assert bool(torch.isfinite(memory[k]).all()), (rank, case, k)
        assert len(errors) == 2, errors
        assert "ZeroOptimizers" in errors[0] and "SGD" in errors[0], errors
        assert "'int8' has error feedback" in errors[1] and "optimizer=opt" in errors[1], errors


def test_fp16_zero_dry_run_counts_the_staged_feedback():
    """--dry-run --zero 1/3 --precision fp16 (meta tensors, fake group, MetaGradScaler): the
    step runs, and the error-feedback memory is twice bf16's: ZeroGradScaler stages a step's
    updates beside the old memory (2 x 4 bytes per gradient element with int8). Stage 3's
    units pad differently from stage 1's buckets (block alignment per unit): within 5%."""
    from dataclasses import replace

    from pyfast.train.config import TrainConfig
    from pyfast.train.dryrun import dry_run
    c = TrainConfig(model="gpt-tiny", dp=2, zero=1, compress="int8", batch=2, seq=32)
    bf16 = dry_run(replace(c, precision="bf16"), 2, [0])[0]["feedback"]
    fp16 = dry_run(replace(c, precision="fp16"), 2, [0])[0]
    assert bf16 > 0 and fp16["feedback"] == 2 * bf16, (fp16, bf16)
    fp16_3 = dry_run(replace(c, precision="fp16", zero=3), 2, [0])[0]
    assert abs(fp16_3["feedback"] - 2 * bf16) <= 0.05 * bf16, (fp16_3, bf16)
