"""`pyfast train --ckpt-async` (pyfast.train.ckpt_async): checkpoints written by DCP's
async_save while training goes on, against the blocking checkpoint.save of the same run.

All distributed cases run in ONE launch of the module's two pool ranks (tests/conftest.py's
pool2) on gpt-tiny (LayerNorms and biases of odd sizes: the whole state, not a toy MLP's):
  - a run with --ckpt-async and one without: the same losses, and each checkpoint holds the
    same values bit for bit (DCP's files read back whole: model, AdamW state, the training
    blobs, each rank's RNG and int8 error-feedback memory); a resume from the async run's
    step 2 then recomputes steps 3-4 byte for byte (json of the float) as the uninterrupted run;
  - staging: rank 1's write held back (a test-only writer waits on an Event) while the next
    step changes the parameters: the checkpoint holds the step it was taken at; nothing is
    visible (no step-N) until every rank's write finished (rank 0 wrote its files at once);
    keep_last deletes the older checkpoint only once the newer is committed, never while it
    is in flight;
  - a failed write (test-only: the writer raises on rank 1 only) raises CheckpointError at the
    next step's poll on every rank, leaves no step-N, keeps the last complete checkpoint;
  - an error that every rank shares (NaN loss, NonFiniteError) while a save is in flight:
    run() commits that checkpoint before it raises.
The fault injection is this file's own (it replaces torch.distributed.checkpoint.async_save's
storage writer in the rank for the duration of a case); pyfast's code has no hook for it.
"""
import json
import os
import threading

import pytest
import torch

FLAGS = dict(model="gpt-tiny", dp=2, compress="int8", steps=4, batch=8, seq=32, seed=1,
             ckpt_every=2, eval_every=2, eval_batches=2, tensorboard="off")


class _Gate:
    """Test-only fault injection: while installed, every async_save writes through a
    FileSystemWriter whose write_data, on the ranks in `held`, first waits for `open`, and
    raises OSError on the ranks in `fail`."""

    def __init__(self, held=(0, 1)):
        self.open, self.fail, self.held = threading.Event(), set(), set(held)
        self.open.set()

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        gate, real = self, dcp.async_save

        class Writer(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                if dist.get_rank() in gate.held:
                    assert gate.open.wait(timeout=120), "the test never opened the gate"
                if dist.get_rank() in gate.fail:
                    raise OSError("injected: No space left on device")
                return super().write_data(plan, planner)

        def async_save(state, *, checkpoint_id, storage_writer=None, **kw):
            return real(state, storage_writer=Writer(checkpoint_id), **kw)
        self._real, dcp.async_save = real, async_save
        return self

    def __exit__(self, *exc):
        import torch.distributed.checkpoint as dcp
        dcp.async_save = self._real


def _cfg(**kw):
    from pyfast.train.config import TrainConfig
    return TrainConfig(**{**FLAGS, **kw})


def _flat(path):
    """A checkpoint directory read back whole, in this process (no collective): {key: tensor,
    or the unpickled blob}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from pyfast.train import checkpoint as ck
    f = f"{path}.pt"
    dcp_to_torch_save(path, f)
    sd = torch.load(f, weights_only=False)
    os.remove(f)
    return {k: ck.unblob(v) if hasattr(v, "getvalue") else v for k, v in sd.items()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _model(job):
    return {n: p.detach().clone() for n, p in job.named}


def _cases(rank, world, root):
    import shutil

    import torch.distributed as dist

    from pyfast.train import checkpoint as ck
    from pyfast.train.ckpt_async import CheckpointError, Checkpointer
    from pyfast.train.job import Job, NonFiniteError
    from pyfast.train.run import run
    cpu, out = torch.device("cpu"), {}

    # 1. blocking vs async: the same run, the same checkpoints; a resume from async's step 2
    for mode in ("blocking", "async"):
        run(_cfg(out=f"{root}/{mode}", ckpt_async=mode == "async"), cpu)
    if rank == 0:
        shutil.copytree(f"{root}/async", f"{root}/resumed")
        ck._remove(ck.root(f"{root}/resumed"), ck.root(f"{root}/resumed") / "step-4")
    dist.barrier()
    run(_cfg(out=f"{root}/resumed", ckpt_async=True, resume=True), cpu)
    if rank == 0:
        out["losses"] = {m: [json.dumps(r["loss"]) for r in _records(f"{root}/{m}")]
                         for m in ("blocking", "async", "resumed")}
        out["identical"] = {s: _same(_flat(f"{root}/blocking/checkpoints/step-{s}"),
                                     _flat(f"{root}/async/checkpoints/step-{s}"))
                            for s in (2, 4)}
        out["keys"] = sorted(_flat(f"{root}/async/checkpoints/step-2"))
        out["async_records"] = _records(f"{root}/async")

    # 2. staging, visibility, keep_last while in flight, then a failed write
    d = f"{root}/gated"
    job, saver = Job(_cfg(out=d), cpu), Checkpointer(True, cpu)
    seen = {}
    with _Gate(held=[1]) as gate:  # rank 0 writes at once, rank 1 when the gate opens
        job.train_step(1)
        saver.save(job, d, 1, keep_last=1)
        saver.finish()
        job.train_step(2)
        at2 = _model(job)
        gate.open.clear()  # rank 1's write of step 2 waits until the step after it ran
        saver.save(job, d, 2, keep_last=1)
        seen["in_flight"] = sorted(os.listdir(ck.root(d)))
        seen["poll_running"] = saver.poll()
        job.train_step(3)
        seen["changed"] = not _same(_model(job), at2)
        seen["still"] = sorted(os.listdir(ck.root(d)))
        gate.open.set()
        saver.finish()
        seen["committed"] = sorted(os.listdir(ck.root(d)))
        got = {"model": {n: torch.empty_like(t) for n, t in at2.items()}}
        ck.load(got, ck.root(d) / "step-2")
        seen["holds_step_2"] = _same(got["model"], at2)
        gate.fail = {1}
        saver.save(job, d, 3, keep_last=1)
        try:
            for s in range(4, 40):  # raised at the first poll that sees rank 1's write fail
                job.train_step(s)
                saver.poll()
            seen["error"] = None
        except CheckpointError as e:
            seen["error"], seen["error_step"] = str(e), s
        seen["after_error"] = sorted(os.listdir(ck.root(d)))
        seen["latest"] = ck.latest(d)[0]
    job.close()
    out["gated"] = seen

    # 3. NaN loss (every rank alike) at step 2 while step 1's save is in flight
    from pyfast.train import job as job_mod
    d = f"{root}/nan"
    step_once = job_mod.Job.train_step

    def train_step(self, step):
        if step == 2:
            gate.open.set()  # step 1's write is released only once step 2 runs
        return step_once(self, step)
    with _Gate() as gate:
        gate.open.clear()
        job_mod.Job.train_step = train_step
        try:
            run(_cfg(out=d, lr=1e30, ckpt_every=1, ckpt_async=True, compress="none"), cpu)
            out["nan"] = "no error"
        except NonFiniteError as e:
            out["nan"] = str(e)
        finally:
            job_mod.Job.train_step = step_once
    out["nan_ckpts"] = sorted(os.listdir(ck.root(d)))
    out["nan_problem"] = ck.problem(ck.root(d) / "step-1", 1)
    return out


@pytest.mark.dist
def test_async_checkpoints_equal_blocking_ones_stage_commit_and_fail_on_every_rank(
        pool2, tmp_path):
    got = pool2.run(_cases, str(tmp_path), timeout=300)
    r0 = got[0]
    # 1. the runs and their checkpoints are the same, bit for bit
    losses = r0["losses"]
    assert losses["async"] == losses["blocking"] and len(losses["blocking"]) == 4, losses
    assert losses["resumed"] == losses["blocking"], losses  # steps 3-4 from async's step 2
    assert r0["identical"] == {2: True, 4: True}
    assert {"model", "optim", "train", "rank0", "rank1"} <= set(r0["keys"]), r0["keys"]
    # the step after a checkpoint logs what it cost: the step blocked for staging (and for a
    # previous save); the async write's time once a poll committed it
    rec3 = r0["async_records"][2]
    assert rec3["ckpt_step"] == 2 and rec3["ckpt_mode"] == "async", rec3
    assert rec3["ckpt_blocked_ms"] >= rec3["ckpt_stage_ms"] > 0, rec3
    for rank, r in enumerate(got):
        g = r["gated"]
        # 2. in flight: no step-2 yet (at most its .tmp- directory), and step 1 is kept
        # (DCP's writer thread makes .tmp-step-2 itself, maybe after the first listing)
        assert set(g["in_flight"]) - {".tmp-step-2"} == {"step-1"}, (rank, g)
        assert g["poll_running"] == {} and g["changed"], (rank, g)
        assert set(g["still"]) - {".tmp-step-2"} == {"step-1"}, (rank, g)
        assert g["committed"] == ["step-2"], (rank, g)  # keep_last=1 after the commit only
        assert g["holds_step_2"], rank  # the staged copy, not the parameters of step 3
        # a failed write on rank 1: an error at a following step's check on every rank, naming
        # the step and the cause (DCP gathers write errors to every rank's future, so both
        # count it; the agreement raises even where a rank's own future had not failed)
        assert g["error"] is not None and "the checkpoint of step 3 failed on" in g["error"], g
        assert "injected: No space left on device" in g["error"], (rank, g["error"])
        assert g["error_step"] < 39, (rank, g)
        assert g["latest"] == 2 and "step-3" not in g["after_error"], (rank, g)
        # 3. the save in flight when a shared error stopped the run was committed first
        assert r["nan"].startswith("step 2: loss nan"), r["nan"]
        assert r["nan_ckpts"] == ["step-1"] and r["nan_problem"] is None, r


def test_ckpt_async_flag_is_free_on_resume_and_a_dry_run_says_it_is_ignored(capsys):
    from pyfast.train import main
    from pyfast.train.config import RESUME_FREE, from_args, parser
    assert from_args(parser().parse_args(["--ckpt-async"])).ckpt_async is True
    assert "ckpt_async" in RESUME_FREE
    assert main(["--dry-run", "--nproc", "2", "--dp", "2", "--model", "gpt-tiny", "--seq", "32",
                 "--batch", "2", "--ckpt-async", "--json"]) == 0
    cap = capsys.readouterr()
    assert "note: --ckpt-async ignored: a dry run writes no checkpoint" in cap.err
    assert json.loads(cap.out)["ranks"]  # --json's stdout is still one JSON object
