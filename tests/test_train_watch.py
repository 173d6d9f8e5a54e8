"""Watching a `pyfast train` run: TensorBoard event files that mirror metrics.jsonl, samples
generated on the job's own mesh (--sample-every), evaluation in eval mode, and the watching
flags' bad input refused before launch.

Generation is checked against a plain greedy decode of the same full model on one process
(built from the same seed, no padding, no mesh): the next-token logits agree within 1e-5
(tp, cp and pp reorder fp32 sums, and the window's padding to --seq changes the matmuls'
shapes; measured <= 2.4e-7 on logits of magnitude <= 0.7, and 0 at dp2 once the window is
full), and the generated ids are equal (a greedy flip would need two logits within that
rounding of each other: about 1e-5 of the chance per token at gpt-tiny's logit spread).
"""
import json
import math
import os

import numpy as np
import pytest
import torch

from pyfast.train.config import ConfigError, TrainConfig, check_watch

SEQ, PROMPT_LEN, NEW = 32, 25, 12  # 25 + 12 > 32: the window slides in the last tokens
MESHES = {  # name: TrainConfig fields on 2 ranks
    "dp2": dict(model="gpt-tiny", dp=2),
    "dp2-zero3": dict(model="gpt-tiny", dp=2, zero=3),
    # hf-llama-tiny splits its vocabulary over tp: the picker gathers the logit shards
    "tp2-vocab-parallel": dict(model="hf-llama-tiny", tp=2),
    "cp2-zigzag": dict(model="gpt-tiny", cp=2),
    "pp2": dict(model="gpt-tiny", pp=2),
}


def _reference(cfg, prompt, n):
    """Greedy decode of the job's initial model on this process alone: (ids, the logits before
    each new token)."""
    from pyfast.train.config import build_model
    torch.manual_seed(cfg.seed)  # as Job: the seed, then the model
    model = build_model(cfg, 256).eval()
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            out = model(torch.tensor([ids[-cfg.seq:]]))[0, -1]
            logits.append(out)
            ids.append(int(out.argmax()))
    return ids[len(prompt):], logits


def _generate_on_mesh(rank, world, fields, prompt):
    from pyfast.train import sample
    from pyfast.train.job import Job
    cfg = TrainConfig(batch=8, seq=SEQ, seed=5, **fields)
    job = Job(cfg, torch.device("cpu"))
    try:
        seen = []  # the picker's next-token logits, by the test's hook on sample.pick
        orig = sample.pick
        sample.pick = lambda logits, k, gen: seen.append(logits.clone()) or orig(logits, k, gen)
        try:
            ids = sample.generate(job, prompt, NEW)
        finally:
            sample.pick = orig
        return ids, seen, job.model.training
    finally:
        job.close()


@pytest.mark.dist
@pytest.mark.parametrize("name", list(MESHES))
def test_generation_on_the_mesh_equals_one_process(pool2, name):
    if MESHES[name]["model"].startswith("hf-"):
        pytest.importorskip("transformers", reason="hf-llama-tiny needs transformers")
    prompt = torch.randint(0, 256, (PROMPT_LEN,)).tolist()
    got = pool2.run(_generate_on_mesh, MESHES[name], prompt, timeout=240)
    want, logits = _reference(TrainConfig(seq=SEQ, seed=5, **MESHES[name]), prompt, NEW)
    assert len(set(want)) > 1  # a real decode, not one repeated token
    for ids, _, training in got:
        assert ids == want  # every rank holds the picked tokens
        assert training  # back in train mode after sampling
    pickers = [seen for _, seen, _ in got if seen]
    assert len(pickers) == 1  # exactly one rank picks
    for a, b in zip(pickers[0], logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_top_k_draws_from_the_k_most_likely_and_repeats_with_its_seed():
    from pyfast.train.sample import pick
    logits = torch.randn(251)
    top = set(logits.topk(5).indices.tolist())
    draws = [pick(logits, 5, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) <= top and len(set(draws)) > 1
    assert draws == [pick(logits, 5, torch.Generator().manual_seed(s)) for s in range(40)]
    assert pick(logits, 0, torch.Generator()) == int(logits.argmax())


def _evaluate_modes(rank, world):
    from pyfast.train.job import Job
    job = Job(TrainConfig(model="gpt-tiny", dp=2, batch=8, seq=SEQ, eval_batches=2, seed=2),
              torch.device("cpu"))
    try:
        job.train_step(1)
        modes = []
        hooks = [m.register_forward_pre_hook(lambda m, a: modes.append(m.training))
                 for m in job.model.modules()]
        in_eval = job.evaluate()
        after = all(m.training for m in job.model.modules())
        for h in hooks:
            h.remove()
        job.model.eval = lambda: job.model  # test-only: evaluate without switching modes
        in_train = job.evaluate()
        return modes, after, in_eval, in_train
    finally:
        job.close()


@pytest.mark.dist
def test_evaluate_runs_in_eval_mode_and_restores_train_mode(pool2):
    for modes, after, in_eval, in_train in pool2.run(_evaluate_modes, timeout=240):
        assert modes and not any(modes)  # every module's forward ran with training False
        assert after  # and every module is back in training mode
        # gpt-tiny has no dropout: eval mode changes no arithmetic, so the losses are identical
        assert math.isfinite(in_eval) and in_eval == in_train


# ---------------------------------------------------------------- bad input and tokenizers
def _cfg(**kw):
    return TrainConfig(**{"model": "gpt-tiny", "seq": SEQ, **kw})


def _prepared(tmp_path, vocab, merges):
    """A prepared data dir as `pyfast data prepare` writes it: manifest.json naming
    tokenizer.json (a Hugging Face tokenizers BPE built here: nothing is downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import Whitespace
    tok = Tokenizer(BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = Whitespace()
    d = tmp_path / "data"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "manifest.json").write_text(json.dumps({"format": "pyfast-tokens/1",
                                                 "tokenizer": "tokenizer.json",
                                                 "vocab_size": len(vocab)}))
    return d


def test_the_data_dirs_tokenizer_json_encodes_and_decodes(tmp_path):
    from pyfast.train.sample import tokenizer_for
    letters = "abcdefgh"
    vocab = {c: i for i, c in enumerate(letters)} | {"ab": 8, "abc": 9, "de": 10}
    d = _prepared(tmp_path, vocab, [("a", "b"), ("ab", "c"), ("d", "e")])
    tok = tokenizer_for(str(d))
    assert tok.name == str(d / "tokenizer.json")
    assert tok.encode("abcde") == [9, 10]  # merges applied: not bytes
    assert tok.encode("hg") == [7, 6]
    assert tok.decode([9, 10, 7]).replace(" ", "") == "abcdeh"
    assert tokenizer_for(str(d / "manifest.json")).encode("ab") == [8]
    assert tokenizer_for(None).decode(list("é".encode()) + [0xFF]) == "é\ufffd"  # bytes
    check_watch(_cfg(data=str(d), sample_every=2, prompt="abc de"))  # accepted


def test_bad_watching_flags_are_refused_with_the_problem_named(tmp_path, monkeypatch):
    def refused(**kw):
        with pytest.raises(ConfigError) as e:
            check_watch(_cfg(**kw))
        return str(e.value)

    assert "--sample-every 3 needs --prompt" in refused(sample_every=3)
    assert "--prompt without --sample-every" in refused(prompt="hi")
    msg = refused(sample_every=1, prompt="x" * (SEQ + 1))
    assert f"{SEQ + 1} tokens" in msg and f"--seq {SEQ}" in msg
    check_watch(_cfg(sample_every=1, prompt="é" * (SEQ // 2)))  # 2 bytes each: exactly --seq
    d = _prepared(tmp_path, {"a": 0, "b": 1, "ab": 2}, [("a", "b")])
    assert "encodes to no tokens" in refused(data=str(d), sample_every=1, prompt="zz zz")
    assert "without a tokenizer" in refused(data=str(tmp_path / "train.bin"), sample_every=1,
                                           prompt="hi")
    assert "--sample-tokens >= 1" in refused(sample_every=1, prompt="hi", sample_tokens=0)
    from pyfast.train import tensorboard
    monkeypatch.setattr(tensorboard, "available", lambda: False)  # as if not installed
    assert "tensorboard package is not installed" in refused(tensorboard="on")
    check_watch(_cfg(tensorboard="auto"))  # auto: off without the package, not an error
    assert not tensorboard.resolve("auto")
    assert "not installed" in tensorboard.describe("auto", tmp_path)


def test_the_launcher_refuses_before_starting_a_rank(tmp_path, capsys):
    from pyfast.train import main
    code = main(["--model", "gpt-tiny", "--seq", str(SEQ), "--out", str(tmp_path / "r"),
                 "--sample-every", "2"])
    assert code == 2 and "--sample-every 2 needs --prompt" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_watch_flags_parse_and_reach_the_ranks():
    from pyfast.train.config import from_args, parser
    from pyfast.train.launch import worker_args
    for argv, want in (([], "auto"), (["--tensorboard"], "on"), (["--no-tensorboard"], "off")):
        cfg = from_args(parser().parse_args(argv + ["--sample-every", "2", "--prompt=-a b"]))
        assert cfg.tensorboard == want
        again = from_args(parser().parse_args(worker_args(cfg)))  # what torchrun's ranks get
        assert again == cfg


# ---------------------------------------------------------------- end to end (torchrun)
def _scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return acc


@pytest.mark.dist
def test_tensorboard_mirrors_metrics_and_samples_are_logged(tmp_path):
    pytest.importorskip("tensorboard")
    from test_train import pool_runs, records
    from pyfast.train.tensorboard import SAMPLE_TAG, tag
    flags = ["--sample-every", "2", "--prompt", "def main(", "--sample-tokens", "8",
             "--sample-top-k", "3"]
    # the jobs on forked ranks, side by side (their launch is not the point here)
    runs = pool_runs({"dp2": (tmp_path / "dp2", 2, ["--dp", "2", "--tensorboard", *flags]),
                      "one": (tmp_path / "one", 1, ["--no-tensorboard", *flags])})
    p = runs["dp2"]
    assert f"tensorboard: {tmp_path / 'dp2' / 'tb'} (--tensorboard" in p.stdout
    assert "sample at step 2 (top-3, 8 tokens): 'def main(" in p.stdout
    assert "tensorboard: off (--no-tensorboard)" in runs["one"].stdout
    assert not (tmp_path / "one" / "tb").exists()
    recs = records(tmp_path / "dp2")
    assert [("sample" in r) for r in recs] == [False, True, True]  # every 2 and at the end
    # the same model up to fp32 rounding at dp2 and on one process, the same seeded draws:
    # the same text (a draw flips only where rounding moves a cumulative probability across
    # the uniform drawn, ~1e-7 of the chance)
    assert [r.get("sample") for r in recs] == [r.get("sample") for r in
                                               records(tmp_path / "one")]
    acc = _scalars(tmp_path / "dp2" / "tb")
    keys = {k for r in recs for k, v in r.items() if k != "step" and not isinstance(v, str)}
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "compute_ms",
            "exposed_comm_ms", "bytes_sent", "max_rss_mb"} <= keys
    assert sorted(acc.Tags()["scalars"]) == sorted(tag(k) for k in keys)
    for k in keys:
        want = [(r["step"], float(np.float32(r[k]))) for r in recs if k in r]
        # event files hold float32 (simple_value): equal to the record's value in float32
        assert [(e.step, e.value) for e in acc.Scalars(tag(k))] == want, k
    texts = acc.Tensors(f"{SAMPLE_TAG}/text_summary")
    assert [t.step for t in texts] == [2, 3]
    assert recs[1]["sample"] in texts[0].tensor_proto.string_val[0].decode()
    assert os.listdir(tmp_path / "dp2" / "tb")


def test_a_resumed_run_purges_the_events_past_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from pyfast.train.tensorboard import TensorBoardLog
    first = [{"step": s, "loss": float(v)} for s, v in zip((1, 2, 3), torch.rand(3))]
    log = TensorBoardLog(tmp_path, 0)
    for r in first:
        log.write(r)
    log.close()
    again = [{"step": s, "loss": float(v) + 1} for s, v in zip((2, 3), torch.rand(2))]
    log = TensorBoardLog(tmp_path, 1)  # resumed from the step-1 checkpoint
    for r in again:
        log.write(r)
    log.close()
    got = [(e.step, e.value) for e in _scalars(tmp_path / "tb").Scalars("loss/train")]
    assert got == [(r["step"], float(np.float32(r["loss"]))) for r in first[:1] + again]


def test_watching_flags_may_change_on_resume():
    import dataclasses
    from pyfast.train.config import resume_changes
    saved = _cfg(steps=4)
    record = {"config": dataclasses.asdict(saved), "warmup_steps": saved.warmup_steps}
    refused, changed = resume_changes(_cfg(steps=4, tensorboard="off", sample_every=2,
                                           prompt="hi", sample_top_k=3), record)
    assert refused == [] and len(changed) == 4
