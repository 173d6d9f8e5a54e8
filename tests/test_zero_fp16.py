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
    cfg = TrainConfig(model="gpt-tiny", dp=2, precision="fp16", zero=zero, compress=compress,
                      steps=steps, batch=4, seq=16, seed=5, lr=1e-3)
    job = Job(cfg, torch.device("cpu"))
    c = (job.zero or job.dp).compressor
    memory = c.feedback.memory if getattr(c, "feedback", None) is not None else {}
    recs, kept = [], []
    try:
        for step in range(1, steps + 1):
            before = {k: v.clone() for k, v in memory.items()}
            orig = job.loss_fn
            if step == OVERFLOW_AT and rank == 1:
                job.loss_fn = lambda logits, target: orig(logits, target) * 1e30
            try:
                rec = job.train_step(step)
            finally:
                job.loss_fn = orig
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
