"""`pyfast export RUN_DIR --to hf OUT_DIR`: short `pyfast train` runs (tests/test_train.py's
BASE: gpt-tiny, 3 steps, checkpoints at 2 and 3) on dp2, tp2, pp2 and ZeRO-3 meshes, exported,
then AutoModelForCausalLM.from_pretrained(OUT_DIR) against pyfast's model at that step.

The reference is built independently of the export's loader: torch's own dcp_to_torch_save
consolidates the (non-ZeRO) checkpoint into whole tensors, which go into models.build's model.
The ZeRO-3 run's weights are compared with the dp2 run of the same flags instead (ZeRO
checkpoints hold flat shards, which dcp_to_torch_save does not reshape).

Tolerances. Logits: |hf - pyfast| <= 1e-5 + 1e-5 |pyfast| (the issue's 1e-5, fp32): the same
weights and the same ops, only summed in another order (GPT-2's Conv1D is addmm on the
transposed weight; NeoX sums q.k over the head dimension in the permuted order); measured 0
(GPT-2) and 7e-7 (NeoX) on logits of size ~2. A wrong QKV order, rotary pairing, GELU variant
or LayerNorm eps changes them by 1e-3 and more (test_gpt_to_hf_same_math's control).
ZeRO-3 vs dp2 weights after 3 AdamW steps: 1e-5 + 1e-5 |w| per element, as
tests/test_train_cp.py argues (sign-like early AdamW updates; rounding noise in a gradient
moves a weight by at most ~1e-4 lr = 1e-7).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from test_train import BASE, ok, pool_runs

transformers = pytest.importorskip("transformers")

from pyfast import models  # noqa: E402
from pyfast.export import (ExportError, data_tokenizer, export, gpt_to_hf,  # noqa: E402
                           load_model, main, write_tokenizer)
from pyfast.train.config import TrainConfig  # noqa: E402

RUNS = {  # name: (nproc, flags, model options of the reference)
    "dp2-learned": (2, ["--dp", "2", "--positions", "learned"],
                    {"positions": "learned"}),
    "tp2-rotary-tied": (2, ["--tp", "2", "--tie-embeddings"], {"tie_embeddings": True}),
    "pp2-rotary": (2, ["--pp", "2"], {}),
    "zero3-learned": (2, ["--dp", "2", "--zero", "3", "--positions", "learned"],
                      {"positions": "learned"}),
    "llama-tp2": (2, ["--model", "hf-llama-tiny", "--tp", "2"], {}),
}
ARCH = {"dp2-learned": "GPT2LMHeadModel", "tp2-rotary-tied": "GPTNeoXForCausalLM",
        "pp2-rotary": "GPTNeoXForCausalLM", "zero3-learned": "GPT2LMHeadModel",
        "llama-tp2": "LlamaForCausalLM"}
SEQ, STEPS = 32, 3  # BASE's


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    jobs = {n: (root / n, nproc, flags + ["--eval-every", "0", "--eval-batches", "1"])
            for n, (nproc, flags, _) in RUNS.items()}
    pool_runs(jobs)
    return {n: root / n for n in RUNS}


def checkpoint_tensors(run, step):
    """The whole model's tensors by name, consolidated by torch's own dcp_to_torch_save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(run / "checkpoints" / f"step-{step}", os.path.join(d, "m.pt"))
        return torch.load(os.path.join(d, "m.pt"), weights_only=False)["model"]


def reference(name, run, step):
    """pyfast's model at `step`, its weights from checkpoint_tensors."""
    model_name = "hf-llama-tiny" if name.startswith("llama") else "gpt-tiny"
    m = models.build(model_name, 256, SEQ, **RUNS[name][2])
    sd = checkpoint_tensors(run, step)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(sd[n])
    return m.eval()


def logits_of(model, ids, hf=False):
    with torch.no_grad():
        return model(input_ids=ids).logits if hf else model(ids)


@pytest.mark.dist
@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("zero")])
def test_export_loads_in_transformers_with_equal_logits(runs, name, tmp_path):
    out = tmp_path / "hf"
    lines = export(runs[name], out, to="hf")
    assert f"step {STEPS}" in lines[0] and "byte-level" in lines[2], lines
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCH[name]
    ref = reference(name, runs[name], STEPS)
    # the export's own loader gives exactly the stored values (no arithmetic on the way)
    _, _, mine = load_model(runs[name] / "checkpoints" / f"step-{STEPS}")
    for (n, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 256, (3, SEQ - 3), generator=torch.Generator().manual_seed(5))
    close(logits_of(hf, ids, hf=True), logits_of(ref, ids), name)
    if "tied" in name:  # one table in the file and in the loaded model
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight


@pytest.mark.dist
def test_zero3_export_equals_dp2(runs, tmp_path):
    export(runs["zero3-learned"], tmp_path / "z", to="hf")
    export(runs["dp2-learned"], tmp_path / "d", to="hf")
    load = transformers.AutoModelForCausalLM.from_pretrained
    z, d = load(tmp_path / "z").eval(), load(tmp_path / "d").eval()
    zs, ds = z.state_dict(), d.state_dict()
    assert zs.keys() == ds.keys()
    for k in ds:
        close(zs[k], ds[k], k)
    _, _, pyf = load_model(runs["zero3-learned"] / "checkpoints" / f"step-{STEPS}")
    ids = torch.randint(0, 256, (2, SEQ - 5), generator=torch.Generator().manual_seed(6))
    close(logits_of(z, ids, hf=True), logits_of(pyf, ids), "zero3")
    start = models.build("gpt-tiny", 256, SEQ, positions="learned")  # the seed's init differs
    assert not torch.allclose(pyf[1].attn.qkv.weight, start[1].attn.qkv.weight, atol=1e-4)


@pytest.mark.dist
def test_step_and_cli(runs, tmp_path):
    """--step picks an earlier checkpoint; the command line through `python -m pyfast`."""
    run, out = runs["dp2-learned"], tmp_path / "s2"
    p = subprocess.run([sys.executable, "-m", "pyfast", "export", str(run), "--step", "2",
                        "--to", "hf", str(out)], capture_output=True, text=True, timeout=120)
    ok(p)
    assert "step 2" in p.stdout and "GPT2LMHeadModel" in p.stdout, p.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref2, ref3 = reference("dp2-learned", run, 2), reference("dp2-learned", run, 3)
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(7))
    got = logits_of(hf, ids, hf=True)
    close(got, logits_of(ref2, ids), "step 2")
    assert not torch.allclose(got, logits_of(ref3, ids), atol=1e-4)  # not the latest step


@pytest.mark.dist
def test_bad_input_named(runs, tmp_path, capsys):
    run = runs["tp2-rotary-tied"]

    def err(*argv):
        assert main([str(a) for a in argv]) == 2
        return capsys.readouterr().err

    assert "not a directory" in err(tmp_path / "nope", "--to", "hf", tmp_path / "o")
    (tmp_path / "plain").mkdir()
    assert "not a run directory" in err(tmp_path / "plain", "--to", "hf", tmp_path / "o")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert "no complete checkpoint" in err(tmp_path / "empty", "--to", "hf", tmp_path / "o")
    e = err(run, "--step", "7", "--to", "hf", tmp_path / "o")
    assert "step 7" in e and "available steps: 2, 3" in e, e
    assert "unknown format" in err(run, "--to", "gguf", tmp_path / "o")
    assert "the run directory" in err(run, "--to", "hf", run, "--force")
    assert "the run directory" in err(run, "--to", "hf", run.parent, "--force")
    assert (run / "checkpoints").is_dir()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    assert "--force" in err(run, "--to", "hf", full)
    assert (full / "keep.txt").exists()  # refused: nothing touched
    assert main([str(run), "--to", "hf", str(full), "--force"]) == 0
    assert not (full / "keep.txt").exists() and (full / "model.safetensors").exists()
    assert not any(p.name.startswith(".tmp-export") for p in tmp_path.iterdir())


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_gpt_to_hf_same_math(positions, monkeypatch):
    """No training run: random weights well away from init (biases, LayerNorm affine), a
    ragged batch; and a control: without the QKV reordering (GPT-2) or the rotary row
    permutation (NeoX) the logits differ."""
    import pyfast.export as ex
    torch.manual_seed(0)
    m = models.build("gpt:layers=3,heads=2,hidden=24,mlp=3", 300, 40, positions=positions)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m.eval()
    ids = torch.randint(0, 300, (3, 37))
    want = logits_of(m, ids)
    close(logits_of(gpt_to_hf(m), ids, hf=True), want, positions)
    # the control: each layout conversion matters (GPT-2: QKV order; NeoX: rotary pairing)
    monkeypatch.setattr(ex, "_halves" if positions == "rotary" else "_qkv_major",
                        lambda w, heads: w)
    assert not torch.allclose(logits_of(gpt_to_hf(m), ids, hf=True), want, atol=1e-3)


def test_tokenizer_written_for_auto_tokenizer(tmp_path):
    """A prepared dataset's tokenizer.json (the PREAMBLE's manifest convention) becomes a
    PreTrainedTokenizerFast that AutoTokenizer loads, ids and EOS equal to the file's own."""
    from tokenizers import Tokenizer, models as tm, pre_tokenizers, trainers
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    tok = Tokenizer(tm.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = ["the quick brown fox jumps over the lazy dog %d times" % i for i in range(50)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120,
                                                      special_tokens=["<unk>", "<eos>"]))
    tok.save(str(data / "tokenizer.json"))
    eos = tok.token_to_id("<eos>")
    manifest = {"format": "pyfast-tokens/1", "tokenizer": "tokenizer.json",
                "vocab_size": tok.get_vocab_size(), "eos_id": eos, "dtype": "uint16"}
    (data / "manifest.json").write_text(json.dumps(manifest))
    found, said = data_tokenizer(TrainConfig(data=str(data)), 128)
    assert found["eos_id"] == eos and "tokenizer.json" in said
    write_tokenizer(found, out, 128, 64)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    s = "the lazy fox jumps 7 times"
    assert auto(s)["input_ids"] == tok.encode(s).ids
    assert auto.eos_token_id == eos and auto.model_max_length == 64
    with pytest.raises(ExportError, match="more than the model's vocabulary of 100"):
        write_tokenizer(found, out, 100, 64)
    manifest["tokenizer"] = "bytes"
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert data_tokenizer(TrainConfig(data=str(data)), 256)[0] is None
    manifest["tokenizer"] = "tokenizer.json"
    (data / "manifest.json").write_text(json.dumps(manifest))
    shutil.move(data / "tokenizer.json", tmp_path / "moved.json")
    with pytest.raises(ExportError, match="is missing"):
        data_tokenizer(TrainConfig(data=str(data)), 256)
