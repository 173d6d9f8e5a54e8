"""`pyfast train --batch-split auto` end to end on 2 ranks (pyfast.train.rebalance in the job):
every step keeps the global batch, a change of split mid-run leaves the update that of the
global batch, two runs give the same parameters, the split goes into checkpoints and back, the
flags' bad input is named, and the dry run runs the even split with a note.

What is compared: gpt-tiny (tied embeddings, LayerNorm and biases of 64 and 256 elements, vocab
256) at dp 2, global batch 8, seq 32, 4 AdamW steps, against the even split's run (the plain
mean that test_train compares with one process). The split changes which rank sums which rows,
so the gradients differ by fp32 rounding (~1e-7 relative); Adam divides each by its own
sqrt(v), so an element whose gradient is near zero can move by up to ~lr a step: parameters
within 1e-5 absolute after 4 steps of lr 1e-3 (warm-up: lr below 1e-3), losses within 1e-5.
"""
import math

import pytest
import torch

from pyfast.train.config import ConfigError, TrainConfig, check

STEPS = 4


def _cfg(**kw):
    return TrainConfig(**{"model": "gpt-tiny", "dp": 2, "batch": 8, "seq": 32, "steps": STEPS,
                          "tie_embeddings": True, "seed": 3, **kw})


def _run(rank, world, fields, force):
    """STEPS steps of a Job; force: {step: split} installed after that step (as a rebalance
    would); returns (records, parameters, the checkpoint's split, restore lines)."""
    from pyfast.train import checkpoint as ck
    from pyfast.train import rebalance
    from pyfast.train.job import Job
    job = Job(_cfg(**fields), torch.device("cpu"))
    try:
        recs = []
        for step in range(1, STEPS + 1):
            recs.append(job.train_step(step))
            if step in force:
                rebalance.apply(job, force[step])
        params = {n: p.detach().clone() for n, p in job.named}
        saved = ck.unblob(job.state(full=False)["train"])["batch_split"]
        notes = []
        if job.balancer is not None:  # what a resume does with a checkpoint's split
            notes.append((rebalance.restore(job, [5, 3]), list(job.split),
                          job.batches.local, job.batches.first, job.dp.samples))
            notes.append((rebalance.restore(job, [2, 2, 4]), list(job.split)))
            notes.append((rebalance.restore(job, None), list(job.split)))
        return recs, params, saved, notes
    finally:
        job.close()


@pytest.mark.dist
def test_auto_keeps_the_global_batch_and_the_update_of_the_even_split(pool2):
    even = pool2.run(_run, {}, {}, timeout=240)
    # every step measured and rebalanced (K = 1), and a split forced after step 2 so that
    # step 3 runs at 6, 2 whatever the timing
    auto = [pool2.run(_run, {"batch_split": "auto", "batch_split_every": 1}, {2: [6, 2]},
                      timeout=240) for _ in range(2)]
    ref_recs, ref = even[0][0], even[0][1]
    for run in auto:
        for rank in (0, 1):
            recs, params, saved, notes = run[rank]
            splits = [r["batch_split"] for r in recs]
            assert all(len(s) == 2 and sum(s) == 8 and min(s) >= 1 for s in splits), splits
            assert splits[0] == [4, 4] and splits[2] == [6, 2], splits  # start even; forced
            assert saved == recs[-1]["rebalance"]["next"]  # the split in force after step 4
            assert all("rebalance" in r for r in recs)  # K = 1: a rebalance every step
            for a, b in zip(recs, ref_recs):
                assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
            worst = max((params[n] - ref[n]).abs().max().item() for n in ref)
            assert worst < 1e-5, f"max |auto - even| parameter difference {worst:.2e}"
        # both ranks hold the same split every step (a pure function of the same gathered numbers)
        assert [r["batch_split"] for r in run[0][0]] == [r["batch_split"] for r in run[1][0]]
    a, b = auto[0][0][1], auto[1][0][1]
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst < 1e-5, f"two auto runs differ by {worst:.2e}"
    # restore(): the checkpoint's split where it fits (rank 0's rows 0-4, samples 5), else even
    notes = auto[0][0][3]
    assert notes[0][0].startswith("--batch-split auto: continuing with the checkpoint's split")
    assert notes[0][1:] == ([5, 3], 5, 0, 5)
    assert auto[0][1][3][0][1:] == ([5, 3], 3, 5, 3)  # rank 1: rows 5-7
    assert notes[1] == ("--batch-split auto: its split [2, 2, 4] is for 3 dp ranks, this run "
                        "has 2; starting again from the even split [4, 4]", [4, 4])
    assert notes[2] == ("--batch-split auto: the checkpoint holds no split; starting again "
                        "from the even split [4, 4]", [4, 4])
    assert even[0][2] is None  # the even split saves none


def test_auto_flags_are_checked_by_name():
    from pyfast.train import batch_split
    # one whole check (it fingerprints the data: seconds on a loaded box); the rest by the module
    check(_cfg(batch_split="auto", batch_split_every=3, batch=10), 2, model=False)  # 5 + 5
    assert batch_split.problem(_cfg(batch_split="auto", batch=12, grad_accum=2)) is None
    assert batch_split.split_of(_cfg(batch_split="auto", batch=10, grad_accum=1, dp=3)) == \
        [4, 3, 3]
    assert batch_split.split_of(_cfg(batch_split="auto", batch=12, grad_accum=2, dp=2)) == [6, 6]
    for kw, msg in [({"batch_split": "auto", "batch_split_every": 0},
                     "--batch-split-every must be >= 1, got 0"),
                    ({"batch_split_every": 4}, "--batch-split-every 4 tunes --batch-split auto"),
                    ({"batch_split": "auto", "batch": 6, "grad_accum": 4},
                     "--batch 6 is not a multiple of --grad-accum 4 x --micro-batches 1 = 4"),
                    ({"batch_split": "auto", "pp": 2, "dp": 1}, "with --pp"),
                    ({"batch_split": "auto", "batch": 2, "grad_accum": 2},
                     "fewer than --dp 2")]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace("+", r"\+")):
            cfg = _cfg(**kw)
            check(cfg, cfg.ranks, model=False)


def test_the_dry_run_runs_the_even_split_with_a_note(capsys):
    from pyfast.train import dryrun
    from pyfast.train.config import parser
    ns = parser().parse_args(["--model", "gpt-tiny", "--dp", "2", "--batch", "8", "--seq", "32",
                              "--batch-split", "auto", "--dry-run", "--json"])
    from pyfast.train.config import from_args
    assert dryrun.main(from_args(ns), ns) == 0
    out = capsys.readouterr()
    assert "--batch-split auto runs the even split on the dry run" in out.err
    assert math.isfinite(__import__("json").loads(out.out)["ranks"][0]["peak_bytes"])
