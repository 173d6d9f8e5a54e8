"""`pyfast train` never silently poisons or changes the run it continues: fp16 overflow steps
under a lossy compressor, resume against the checkpoint's record, checkpoint integrity and
rotation, --data checked before launch, the optional plot and torch's lower bound.

Everything but the fp16 case runs in the test process (the checks run before any rank would);
the fp16 case builds the job's Job on the two ranks of the shared pool, without torchrun.
"""
import math

import pytest
import torch

FP16_STEPS = 6


def _fp16_overflow(rank, world, overflow_at, seed=3, steps=FP16_STEPS, lr=1e-3):
    """Steps 1..FP16_STEPS of gpt-tiny at --dp 2 --precision fp16 --compress int8; at step
    `overflow_at` (0: never) rank 1's loss is scaled by 1e30 so that its fp16 gradients overflow
    (a test-only hook: the job's own loss function, wrapped here). Returns per step the record,
    whether the feedback memory was finite, and (around the overflow step) whether it equals
    its value before the step."""
    from pyfast.train.config import TrainConfig
    from pyfast.train.job import Job
    from dist_utils import job_step
    cfg = TrainConfig(model="gpt-tiny", dp=2, precision="fp16", compress="int8", steps=steps,
                      batch=8, seq=32, seed=seed, lr=lr)
    job = Job(cfg, torch.device("cpu"))
    memory = job.dp.compressor.feedback.memory
    out = []
    try:
        for step in range(1, steps + 1):
            before = {k: v.clone() for k, v in memory.items()}
            rec = job_step(job, step, overflow=step == overflow_at and rank == 1)
            same = before.keys() == memory.keys() and all(
                torch.equal(before[k], memory[k]) for k in before)
            finite = all(bool(torch.isfinite(v).all()) for v in memory.values())
            out.append({**rec, "memory_finite": finite, "memory_unchanged": same,
                        "memory_size": sum(v.numel() for v in before.values())})
    finally:
        job.close()
    return out


@pytest.mark.dist
def test_fp16_overflow_under_int8_is_skipped_everywhere_and_training_goes_on(pool2):
    """GradScaler's first step at scale 2^16 already overflows here (in gpt-tiny's
    attn.proj.bias on rank 1): step 2 is the first update, so the forced overflow is at step 3,
    where the feedback memory holds step 2's residual (at step 2 it would still be empty).
    Before the job used DataParallel's "skip", step 1's overflow put NaN into rank 1's memory
    and every later step skipped."""
    hit = pool2.run(_fp16_overflow, 3, timeout=240)
    ref = pool2.run(_fp16_overflow, 0, timeout=240)
    for rank in (0, 1):
        h, r = hit[rank], ref[rank]
        assert [x["skipped"] for x in r] == [True] + [False] * (FP16_STEPS - 1), rank
        assert [x["skipped"] for x in h] == [True, False, True] + [False] * (FP16_STEPS - 3)
        # each skipped step left every rank's error-feedback memory exactly as it was (a copy
        # put back: bitwise by construction), non-empty at step 3, and finite throughout
        assert h[0]["memory_unchanged"] and h[2]["memory_unchanged"], rank
        assert h[2]["memory_size"] > 0 and all(x["memory_finite"] for x in h), rank
        assert h[3]["loss_scale"] == h[2]["loss_scale"] / 2  # GradScaler backed off once
    # the loss curve from step 4 on follows the run without the overflow, one AdamW update
    # behind on the same batches: measured 2.5%, 1.7%, 1.4% apart at steps 4-6 (seeds 0 and 1:
    # at most 2.2%), while batch noise alone moves the reference by up to 2.9% between
    # consecutive steps: 3.5% is "within noise"; a run that stops updating falls behind
    # further at every step.
    hl, rl = [x["loss"] for x in hit[0][3:]], [x["loss"] for x in ref[0][3:]]
    assert all(math.isfinite(v) for v in hl)
    assert max(abs(a - b) / b for a, b in zip(hl, rl)) < 0.035, (hl, rl)


# ------------------------------------------------------------------ resume against the record
TINY = ["--model", "gpt-tiny", "--steps", "8", "--batch", "8", "--seq", "32", "--no-plot"]


def recorded_checkpoint(out, step, flags, meta_text=None):
    """A checkpoint directory as Job.save commits it, its meta.json recording the run of
    `flags` (the shards are stand-ins: these checks never read them)."""
    import dataclasses
    import json

    from pyfast.train import config
    cfg = config.from_args(config.parser().parse_args(flags))
    d = out / "checkpoints" / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    (d / "__0_0.distcp").write_bytes(b"x")
    meta = {"step": step, "model_key": cfg.model_key(), "config": dataclasses.asdict(cfg),
            "warmup_steps": cfg.warmup_steps, "data": config.check_data(cfg)}
    (d / "meta.json").write_text(meta_text if meta_text is not None else json.dumps(meta))
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A 40 KB text corpus (random printable bytes: ragged, never zeros) and another one of
    the same size."""
    import random
    root = tmp_path_factory.mktemp("corpus")
    rnd = random.Random(7)
    for name in ("a.txt", "b.txt"):
        (root / name).write_bytes(bytes(rnd.randrange(32, 127) for _ in range(40_000 + 13)))
    return root


@pytest.mark.parametrize("saved,resumed,message", [
    (["--lr", "1e-3"], ["--lr", "2e-3"], "--lr: 0.001 in the checkpoint, 0.002 here"),
    (["--warmup", "2"], ["--warmup", "3"], "--warmup: 2 in the checkpoint, 3 here"),
    (["--min-lr-ratio", "0.1"], ["--min-lr-ratio", "0.2"], "--min-lr-ratio: 0.1 in the"),
    (["--seed", "1"], ["--seed", "2"], "--seed: 1 in the checkpoint, 2 here"),
    (["--dp", "2", "--compress", "int8"], ["--dp", "2", "--compress", "int4"],
     "--compress: int8 in the checkpoint, int4 here"),
    (["--dp", "2", "--compress", "int8"], ["--dp", "2", "--compress", "int8",
                                           "--error-feedback", "off"],
     "--error-feedback: on in the checkpoint, off here"),
    (["--dp", "2", "--compress", "int8", "--bucket-mb", "4"],
     ["--dp", "2", "--compress", "int8", "--bucket-mb", "8"],
     "--bucket-mb: 4.0 in the checkpoint, 8.0 here"),
    (["--precision", "bf16"], [], "--precision: bf16 in the checkpoint, fp32 here"),
    (["--dp", "2", "--zero", "2"], ["--dp", "2"], "--zero: 2 in the checkpoint, 0 here (ZeRO"),
    ([], ["--steps", "12"], "--steps: 8 in the checkpoint, 12 here (pass --allow-change steps"),
    # the default warm-up follows --steps: an extended run must pin the old one
    ([], ["--steps", "20", "--allow-change", "steps"],
     "--warmup: 1 in the checkpoint, 2 here (resolved from --steps; pass --warmup 1)"),
    ([], ["--steps", "3", "--allow-change", "steps"], "the checkpoint is at step 4 already"),
    (["--data", "a.txt"], ["--data", "b.txt"], "--data: "),
    ([], ["--allow-change", "lr"], "--allow-change lr: only steps may be allowed"),
])
def test_resume_refuses_another_run_before_any_rank_starts(tmp_path, capsys, corpus, saved,
                                                           resumed, message):
    def fix(flags):  # corpus files by name
        return [str(corpus / f) if f.endswith(".txt") else f for f in flags]
    recorded_checkpoint(tmp_path, 4, TINY + fix(saved) + ["--out", str(tmp_path)])
    from pyfast.train import main
    assert main(TINY + fix(resumed) + ["--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert message in err and "step-4" in err or "--allow-change lr" in err, err


def test_resume_allows_the_mesh_cadence_and_steps_when_asked_and_says_so(tmp_path, corpus):
    from pyfast.train.config import from_args, parser
    from pyfast.train.run import check_resume
    data = ["--data", str(corpus / "a.txt")]
    recorded_checkpoint(tmp_path, 4, TINY + data + ["--dp", "2", "--eval-every", "2",
                                                    "--out", str(tmp_path)])
    moved = tmp_path / "moved.txt"  # the same bytes elsewhere: same fingerprint
    moved.write_bytes((corpus / "a.txt").read_bytes())
    flags = TINY + ["--data", str(moved), "--out", str(tmp_path), "--resume", "--tp", "2",
                    "--eval-every", "1", "--steps", "12", "--warmup", "1",
                    "--allow-change", "steps"]
    said = []
    found = check_resume(from_args(parser().parse_args(flags)), False, said.append)
    assert found[0] == 4
    text = "\n".join(said)
    for change in ("--dp: 2 in the checkpoint, 1 here", "--tp: 1 in the checkpoint, 2 here",
                   "--eval-every: 2 in the checkpoint, 1 here",
                   "--steps: 8 in the checkpoint, 12 here", f"--data: {corpus / 'a.txt'}"):
        assert change in text, text


def test_truncated_and_foreign_checkpoints_are_skipped_with_a_warning(tmp_path, capsys):
    """The latest whole checkpoint is step 2 (its run recorded another --lr, so the refusal
    names the directory picked); steps 4 and 6 are skipped by name."""
    out = ["--out", str(tmp_path)]
    recorded_checkpoint(tmp_path, 2, TINY + out + ["--lr", "5e-4"])
    recorded_checkpoint(tmp_path, 4, TINY + out, meta_text='{"step": 4, "model_ke')
    recorded_checkpoint(tmp_path, 6, TINY + out, meta_text='{"step": 6, "weights": "x"}')
    from pyfast.train import main
    assert main(TINY + out + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "step-2 was written by another run; --lr: 0.0005 in the checkpoint" in err, err
    assert f"skipping checkpoint {tmp_path}/checkpoints/step-4: meta.json is unreadable or " \
           "truncated (JSONDecodeError" in err, err
    assert f"skipping checkpoint {tmp_path}/checkpoints/step-6: meta.json is not this job's " \
           "record of step 6 (a foreign checkpoint)" in err, err


# ------------------------------------------------------------------ checkpoint commit, rotation
@pytest.fixture
def world1():
    """A one-rank gloo group in this process (ck.save is collective)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_checkpoint_commit_is_fsynced_and_keep_last_deletes_only_after_a_newer_one(
        tmp_path, world1, monkeypatch):
    import os

    from pyfast.train import checkpoint as ck
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    state = {"w": torch.randn(13, 7)}
    ck.save(state, tmp_path, 1, {"model_key": {}})
    root = str(tmp_path / "checkpoints")
    # meta.json through a temporary file (never a truncated meta.json), the directory holding
    # it, and the parent after the rename
    assert any(p.startswith(root + "/.tmp-step-1/.meta.") for p in synced), synced
    assert root + "/.tmp-step-1" in synced and synced[-1] == root, synced
    assert ck.read_meta(tmp_path / "checkpoints" / "step-1")["step"] == 1
    for step in (2, 3):
        ck.save({"w": torch.randn(13, 7)}, tmp_path, step, {"model_key": {}}, keep_last=2)
    assert [s for s, _ in ck.complete(tmp_path)] == [2, 3]

    def crash(point, step):  # killed mid-checkpoint: nothing older may be gone
        raise RuntimeError("killed")
    with pytest.raises(RuntimeError, match="killed"):
        ck.save({"w": torch.randn(13, 7)}, tmp_path, 4, {"model_key": {}}, crash, keep_last=2)
    assert [s for s, _ in ck.complete(tmp_path)] == [2, 3]
    w4 = torch.randn(13, 7)
    ck.save({"w": w4}, tmp_path, 4, {"model_key": {}}, keep_last=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-3", "step-4"]
    got = {"w": torch.empty(13, 7)}
    ck.load(got, tmp_path / "checkpoints" / "step-4")  # the rerun of step 4 is the one kept
    assert torch.equal(got["w"], w4)


# ------------------------------------------------------------------ --data before launch
def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "nope.txt", "corpus not found: {d}/nope.txt"),
    (lambda d: _write(d / "empty.txt", b""), "empty corpus: {d}/empty.txt is empty"),
    (lambda d: (d / "hollow").mkdir() or d / "hollow", "empty corpus: no files under"),
    (lambda d: _write(d / "short.txt", b"q" * 200),
     "its 180 training bytes at --seq 32 make 5 sequences, fewer than one global batch of "
     "--batch 8"),
    (lambda d: _write(d / "odd.bin", bytes(range(1, 200)) * 7),
     "{d}/odd.bin has 1393 bytes, an odd number: not a uint16 token file"),
    (lambda d: _write(d / "wide.bin", torch.randint(1, 50_000, (4096,), dtype=torch.int32)
                      .numpy().tobytes()),
     "{d}/wide.bin looks like 32-bit tokens (every second uint16 of its first MB is 0)"),
    (lambda d: _write(d / "ids.npy", b"\x93NUMPY" + bytes(500)), "not a corpus format"),
    (lambda d: _write(d / "ids.dat", bytes(range(256)) * 40), "NUL bytes in its first MB"),
    (lambda d: _write(d / "tiny.bin", bytes(range(1, 201)) * 2),
     "its 180 training uint16 tokens at --seq 32 make 5 sequences"),
])
def test_bad_data_fails_before_any_rank_starts(tmp_path, capsys, make, message):
    from pyfast.train import main
    path = make(tmp_path)
    out = tmp_path / "out"
    assert main(TINY + ["--data", str(path), "--out", str(out), "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert f"pyfast train: error: --data {path}: " in err, err
    assert message.format(d=tmp_path) in err, err
    assert not out.exists()


def test_data_check_counts_the_training_tokens_load_corpus_makes(tmp_path):
    """check() finds the train split from sizes alone: it must be load_corpus's, for each kind
    of corpus (ragged sizes; a folder whose files land on both sides and one whose do not)."""
    import numpy as np

    from pyfast.data import check, is_val_file, load_corpus
    g = torch.Generator().manual_seed(5)
    text = _write(tmp_path / "t.txt", torch.randint(32, 127, (12_345,), generator=g)
                  .to(torch.uint8).numpy().tobytes())
    tokens = torch.randint(1, 60_000, (9_999,), generator=g).to(torch.int32).numpy()
    one = _write(tmp_path / "one.bin", tokens.astype(np.uint16).tobytes())
    pair = tmp_path / "pair"
    pair.mkdir()
    _write(pair / "train.bin", tokens[:8000].astype(np.uint16).tobytes())
    _write(pair / "val.bin", tokens[8000:].astype(np.uint16).tobytes())
    both = tmp_path / "both"  # names chosen so that some go to val by crc32
    both.mkdir()
    names = [f"f{i}.py" for i in range(300)]
    assert any(is_val_file(n) for n in names) and not all(is_val_file(n) for n in names)
    for i, n in enumerate(names):
        _write(both / n, bytes([65 + i % 26]) * (37 + i))
    single = tmp_path / "single"
    single.mkdir()
    _write(single / "f0.py", b"x = 1\n" * 999)
    for path in (text, one, pair / "train.bin", both, single):
        assert check(str(path), 2, 16)["train"] == len(load_corpus(str(path)).train), path
    # the fingerprint sees a change of content at equal size
    a = check(str(text), 2, 16)
    text.write_bytes(text.read_bytes()[::-1])
    assert check(str(text), 2, 16)["blake2b"] != a["blake2b"]


# ------------------------------------------------------------------ optional plot, torch bound
def test_plot_without_matplotlib_is_a_one_line_notice(tmp_path, monkeypatch):
    import sys

    from pyfast.train.metrics import plot
    recs = [{"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 900.0 + s} for s in (1, 2, 3)]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    note = plot(recs, tmp_path / "curves.png")
    assert note == "plot: none (matplotlib is not installed: pip install 'pyfast[plot]')"
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.parametrize("version,ok", [("2.5.1", False), ("2.4.0+cu121", False),
                                        ("1.13.1", False), ("2.6.0", True),
                                        ("2.6.0a0+git1234", True), ("2.13.0+cpu", True)])
def test_torch_lower_bound_is_checked_and_named(version, ok):
    import pyfast
    if ok:
        pyfast.check_torch(version)
        return
    with pytest.raises(ImportError) as e:
        pyfast.check_torch(version)
    assert "pyfast needs torch >= 2.6" in str(e.value) and f"has torch {version}" in str(e.value)


def test_pyproject_torch_bound_is_the_checked_one():
    import os
    import re

    import pyfast
    text = open(os.path.join(os.path.dirname(pyfast.__file__), os.pardir,
                             "pyproject.toml")).read()
    bounds = set(re.findall(r'"torch>=([0-9.]+)"', text))
    assert bounds == {".".join(map(str, pyfast.TORCH_MIN))}, bounds


@pytest.mark.dist
def test_a_real_run_extended_with_allow_change_steps_keeps_the_last_checkpoint(tmp_path, capsys):
    """The record a real job writes round-trips: an unchanged --resume passes, --steps needs
    --allow-change steps and is logged; --keep-last 1 leaves only the newest checkpoint."""
    from pyfast.train import main
    from test_train import BASE, ok, pool_runs, records, train
    out, flags = tmp_path / "run", ["--ckpt-every", "1", "--keep-last", "1"]
    # the first run's records are what is tested, not its launch: the job on a forked rank
    pool_runs({"run": (out, 1, flags + ["--steps", "2", "--eval-every", "0"])})
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    # refused before any rank starts: the command's own function, in this process
    assert main(BASE + ["--out", str(out)] + flags + ["--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "pass --allow-change steps" in err, err
    p = ok(train(out, 0, flags + ["--steps", "3", "--resume", "--allow-change", "steps"]))
    assert "changed flag: --steps: 2 in the checkpoint, 3 here" in p.stderr, p.stderr
    assert [r["step"] for r in records(out)] == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3"]
