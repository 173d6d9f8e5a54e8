"""`pyfast train --elastic` (pyfast.train.elastic): a restart at another world size re-plans dp,
keeps the global batch by accumulation, reshards the checkpoint and continues the same run.

The 4 -> 2 -> 4 chain runs the job's own per-rank function (pyfast.train.run.run) on the
session's forked 4- and 2-rank pools (test_train.pool_runs), as torchrun's ranks run it.
Tolerance of the chain against the uninterrupted 4-rank run: 1e-5 relative per step. Every global
step reads the same 8 sequences at dp 4 or 2 (pyfast.data.Batches) and the loss is their mean,
so only the order of the fp32 sums differs (per-rank means of 2 or 4 sequences, averaged over 4
or 2 ranks); test_train's dp/tp/pp configs hold 1e-5 for the same reason (measured <= 2e-7 over
three steps; the chain here measured 2.4e-8 over six).
"""
import pytest
import torch

from pyfast.train.config import ConfigError, TrainConfig

# --warmup and --lr-decay-steps fixed: the legs stop at --steps 2 and 4 (--allow-change steps),
# and the schedule must be the 6-step run's in every leg
FLAGS = ["--dp", "4", "--elastic", "--ckpt-every", "2", "--eval-every", "0", "--warmup", "1",
         "--lr-decay-steps", "6"]


def _legs(out, steps, nproc):
    extra = ["--allow-change", "steps"] if steps > 2 else []
    return (out, nproc, FLAGS + ["--steps", str(steps)] + extra)


@pytest.mark.dist
def test_elastic_4_to_2_to_4_follows_the_uninterrupted_run(tmp_path, capsys):
    """Measured: the chain's losses equal the uninterrupted run's within 2.4e-8 relative (steps 1-4
    bit for bit, 5-6 by 2.4e-8): well inside the 1e-5 bound of the module docstring."""
    from test_train import pool_runs, records
    ref, chain = tmp_path / "ref", tmp_path / "chain"
    # the reference (4 ranks) beside the first leg would share the 4-rank pool: the 2-rank
    # leg goes beside the reference instead
    pool_runs({"a": _legs(chain, 2, 4)})
    pool_runs({"ref": (ref, 4, FLAGS + ["--steps", "6"]), "b": _legs(chain, 4, 2)})
    pool_runs({"c": _legs(chain, 6, 4)})
    want, got = records(ref), records(chain)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    rel = [abs(g["loss"] - w["loss"]) / w["loss"] for g, w in zip(got, want)]
    assert max(rel) < 1e-5, rel
    # the first leg is the reference's mesh and schedule: bit for bit
    assert [r["loss"] for r in got[:2]] == [r["loss"] for r in want[:2]]
    assert got[2]["elastic"] == ("elastic restart at step 2: world 4 -> 2, dp 4 -> 2, grad "
                                 "accumulation 1 -> 2 (global batch 8 kept)")
    assert got[4]["elastic"] == ("elastic restart at step 4: world 2 -> 4, dp 2 -> 4, grad "
                                 "accumulation 2 -> 1 (global batch 8 kept)")
    assert not any("elastic" in r for r in want)  # the planned mesh is the flags': no line
    # the checkpoint of each leg records the mesh it ran at
    import json
    meta = json.loads((chain / "checkpoints" / "step-4" / "meta.json").read_text())
    assert meta["mesh"]["dp"] == 2 and meta["config"]["grad_accum"] == 2
    # any other change is refused as --resume refuses it, before a rank starts
    from pyfast.train import main
    from test_train import BASE
    capsys.readouterr()
    assert main(BASE + ["--out", str(chain), *_legs(chain, 8, 2)[2], "--lr", "2e-3",
                        "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "--lr: 0.001 in the checkpoint, 0.002 here" in err and "--dp:" not in err, err


@pytest.mark.dist
def test_elastic_zero2_4_to_2_reshards_the_flat_shards(tmp_path):
    """--zero 2: the 4-rank run's step-2 checkpoint (flat shards of 4 ranks) continued on 2 ranks
    equals the uninterrupted 4-rank run's steps 3-4 within the chain's 1e-5."""
    import shutil

    from test_train import pool_runs, records
    ref, run = tmp_path / "ref", tmp_path / "run"
    flags = FLAGS[:-1] + ["4", "--zero", "2", "--steps", "4"]  # --lr-decay-steps 4
    pool_runs({"ref": (ref, 4, flags)})
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step-4")
    pool_runs({"run": (run, 2, flags)})
    want, got = records(ref), records(run)
    assert got[2]["elastic"].startswith("elastic restart at step 2: world 4 -> 2, dp 4 -> 2")
    rel = [abs(g["loss"] - w["loss"]) / w["loss"] for g, w in zip(got, want)]
    assert [r["step"] for r in got] == [1, 2, 3, 4] and max(rel) < 1e-5, rel


def _ef_after_load(rank, world, out):
    """Each rank's Job at --elastic for this world, loaded from out's latest checkpoint:
    (same, error-feedback elements and their squared norm, the warning)."""
    from pyfast.train import checkpoint as ck
    from pyfast.train.config import plan_world as plan
    from pyfast.train.elastic import describe_reset
    from pyfast.train.job import Job
    cfg = plan(TrainConfig(model="gpt-tiny", dp=4, compress="int8", batch=8, seq=32, seed=1,
                           steps=2, elastic=True, out=str(out)), world)
    job = Job(cfg, torch.device("cpu"))
    try:
        step, path = ck.latest(out)
        _, same = job.load(path)
        mem = job.dp.compressor.feedback.memory
        return (same, sum(v.numel() for v in mem.values()),
                float(sum(v.double().square().sum() for v in mem.values())),
                describe_reset(cfg, ck.read_meta(path), same))
    finally:
        job.close()


@pytest.mark.dist
def test_error_feedback_memory_restarts_from_zero_when_dp_changes(tmp_path):
    """A 2-rank int8 run's checkpoint: loaded at 2 ranks every rank gets its own memory back;
    loaded at 4 (elastic 2 -> 4) there are 4 memories to fill from 2, which does not split:
    every rank starts with none (zero), and the run says so."""
    from test_train import _pool, pool_runs
    out = tmp_path / "int8"
    pool_runs({"int8": (out, 2, ["--dp", "2", "--compress", "int8", "--steps", "2"])})
    _pool(2).submit(_ef_after_load, out)  # the session's pools, side by side
    _pool(4).submit(_ef_after_load, out)
    kept, reset = _pool(2).wait(), _pool(4).wait()
    for same, n, sq, why in kept:
        assert same and n > 0 and sq > 0 and why is None
    for same, n, sq, why in reset:
        assert not same and n == 0 and sq == 0.0
        assert "2 in the checkpoint, 4 now" in why and "starts from zero" in why, why


def _cfg(**kw):
    return TrainConfig(**{"model": "gpt-tiny", "batch": 32, "seq": 32, "elastic": True, **kw})


def test_plan_keeps_tp_pp_cp_and_the_global_batch():
    from pyfast.train.config import plan_world as plan
    # the flags' micro-batch: 32 / (4 x 1 x 1) = 8 sequences; dp follows the world
    for world, dp, accum in ((4, 4, 1), (2, 2, 2), (1, 1, 4)):
        c = plan(_cfg(dp=4), world)
        assert (c.dp, c.grad_accum, c.tp, c.batch) == (dp, accum, 1, 32)
    c = plan(_cfg(dp=2, tp=2, pp=2), 4)  # pp 2: micro-batches 2 x pp = 4, micro-batch 4
    assert (c.dp, c.tp, c.pp, c.grad_accum, c.m) == (1, 2, 2, 2, 4)
    c = plan(_cfg(dp=2, elastic=False), 3)
    assert (c.dp, c.grad_accum) == (2, 1)  # without --elastic the flags are the mesh


@pytest.mark.parametrize("kw,world,msg", [
    ({"dp": 2, "tp": 2}, 3, "a world of 3 ranks is not divisible by tp 2 x pp 1 x cp 1 = 2"),
    ({"dp": 1, "tp": 2, "cp": 2}, 6, "dp would be 6 / 4 = 1.5"),
    ({"dp": 4}, 8, "--batch 32 is not divisible by dp 8 x micro-batches 1 x micro-batch 8 = 64"),
    ({"dp": 4}, 3, "--batch 32 is not divisible by dp 3 x micro-batches 1 x micro-batch 8 = 24"),
    ({"dp": 3}, 3, "--batch 32 is not divisible by dp 3 x grad-accum 1 x micro-batches 1 = 3"),
    ({"dp": 2, "diloco": 2, "replicas": 2}, 4, "--elastic with --diloco"),
])
def test_plan_refuses_with_the_numbers(kw, world, msg):
    from pyfast.train.config import plan_world as plan
    with pytest.raises(ConfigError) as e:
        plan(_cfg(**kw), world)
    assert msg in str(e.value), str(e.value)


def test_launcher_refuses_before_starting_ranks_and_describes_the_plan(tmp_path, capsys):
    """The launcher plans for --nproc as the ranks will (no rank is started for a refusal);
    the dry run plans for its --nproc and prints the change."""
    from pyfast.train import main
    base = ["--model", "gpt-tiny", "--batch", "8", "--seq", "32", "--out", str(tmp_path / "o"),
            "--elastic"]
    assert main(base + ["--tp", "2", "--nproc", "3"]) == 2
    assert "a world of 3 ranks is not divisible by tp 2" in capsys.readouterr().err
    assert main(base + ["--dp", "4", "--nproc", "2", "--dry-run", "--json"]) == 0
    cap = capsys.readouterr()
    assert "dp 4 -> 2, grad accumulation 1 -> 2 (global batch 8)" in cap.err, cap.err
    assert '"ranks"' in cap.out


def test_describe_names_every_change():
    from pyfast.train.elastic import describe
    cfg = _cfg(dp=2, grad_accum=2)
    meta = {"mesh": {"dp": 4, "tp": 1, "pp": 1, "cp": 1}, "config": {"grad_accum": 1}}
    assert describe(cfg, meta, 6) == ("elastic restart at step 6: world 4 -> 2, dp 4 -> 2, grad "
                                      "accumulation 1 -> 2 (global batch 32 kept)")
    meta = {"mesh": {"dp": 2, "tp": 1, "pp": 1}, "config": {"grad_accum": 2}}  # before --cp
    assert describe(cfg, meta, 6) == "elastic restart at step 6: world 2 (unchanged)"
    assert describe(cfg, None, flags=cfg) is None  # a fresh start at the flags' mesh
