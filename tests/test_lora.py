"""LoRA fine-tuning (--lora): pyfast's adapters against references, and through the training job.

References: peft's own get_peft_model on an identical copy of the model, for hf-llama-tiny (GQA,
RMSNorm) and pyfast's gpt-tiny (LayerNorm with biases); for gpt-tiny also the merged-weight
formula W + (alpha / r) B A run through the base model itself (torch.func.functional_call).
All in fp32, random lora_B (peft's init is zeros, which would leave every gradient of A zero),
logits and every adapter gradient within atol 1e-5 (gradients also within fp32's rtol 1.3e-6:
they reach ~20).

The job (pyfast.train.job.Job on forked gloo ranks, as `pyfast train` runs it): hf-llama-tiny
with --lora 4 on one rank, dp2, dp2 --zero 2 and 3, pp2 and two DiLoCo replicas in bf16 (one
module fixture, 4 steps each), then a resume from step 2; an int8 base sharded by --zero 3,
resumed from step 2 with the base replicated (bit-exact). Tolerances: the meshes agree with one rank
within 1e-5 relative on the losses (as tests/test_train.py) and within 1e-3 x lr x steps
absolute on the adapters after 4 steps (measured: 3e-7 to 4.6e-6 at lr 3e-3, by data; fp32
sums reordered, see test_lora_meshes_train_as_one_rank).
"""
import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from pyfast import models
from pyfast.models.lora import LoraOptions, adapter_params, apply_lora, is_adapter
from pyfast.train import main
from pyfast.train.config import ConfigError, TrainConfig, resume_changes
from pyfast.train.job import autocast_layers, store_frozen_linear


transformers = pytest.importorskip("transformers", reason="hf-llama-tiny needs transformers")

VOCAB, SEQ = 256, 32
# gradients of sum(logits x N(0, 1)) reach ~20: fp32 rounding of such sums is 1e-6 relative
# (torch.testing's own fp32 rtol), measured 1.0e-6 on gpt-tiny's mlp.proj
RTOL = 1.3e-6


def _random_b(model, seed=1):
    """lora_B drawn N(0, 0.02) (peft starts it at zeros: no gradient would reach lora_A)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def test_hf_llama_lora_equals_peft_get_peft_model():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    ours = models.build("hf-llama-tiny", VOCAB, SEQ)
    ref = copy.deepcopy(ours.hf)  # identical base weights
    apply_lora(ours, LoraOptions(rank=4, alpha=8))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert sorted(ours.lora_modules) == sorted(
        n.removeprefix("base_model.model.") for n, m in ref.named_modules()
        if hasattr(m, "lora_A") and n.endswith(tuple(targets)))
    _random_b(ours)
    mine = dict(adapter_params(ours))
    theirs = {n.removeprefix("base_model.model."): p for n, p in ref.named_parameters()
              if p.requires_grad}
    assert sorted(theirs) == sorted(n.removeprefix("hf.") for n in mine)
    with torch.no_grad():  # the same adapters: ours (A: peft's init from another draw) into peft's
        for n, p in mine.items():
            theirs[n.removeprefix("hf.")].copy_(p)
    x = torch.randint(0, VOCAB, (2, SEQ))
    got, want = ours(x), ref(input_ids=x).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    w = torch.randn_like(got)
    (got * w).sum().backward()
    (want * w).sum().backward()
    for n, p in mine.items():
        assert p.grad is not None and p.grad.abs().max() > 0, n
        torch.testing.assert_close(p.grad, theirs[n.removeprefix("hf.")].grad, atol=1e-5,
                                   rtol=RTOL, msg=lambda s, n=n: f"{n}: {s}")
    frozen = [n for n, p in ours.named_parameters() if not is_adapter(n)]
    assert frozen and all(ours.get_parameter(n).grad is None for n in frozen)
    assert all(not ours.get_parameter(n).requires_grad for n in frozen)


def test_gpt_lora_equals_peft_and_the_merged_weight_reference():
    """pyfast's GPT (LayerNorm with biases, fused qkv) with adapters on two of its Linear kinds
    against peft's get_peft_model on a copy, and against the plain GPT run with W + alpha/r B A
    in place of each adapted W (the LoRA paper's formula, by autograd)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    base = models.build("gpt-tiny", VOCAB, SEQ)
    ours = copy.deepcopy(base)
    opts = LoraOptions(rank=4, alpha=6, targets="attn.qkv,mlp.proj")
    apply_lora(ours, opts)
    _random_b(ours)
    mods = ours.lora_modules
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=6,
                                                          target_modules=list(mods)))
    theirs = {n.removeprefix("base_model.model."): p for n, p in peft.named_parameters()
              if p.requires_grad}
    mine = dict(adapter_params(ours))
    assert sorted(theirs) == sorted(mine) and len(mine) == 2 * 2 * 2  # 2 layers x 2 kinds x A, B
    with torch.no_grad():
        for n, p in mine.items():
            theirs[n].copy_(p)
    x = torch.randint(0, VOCAB, (2, SEQ))
    got = ours(x)
    # reference: the plain GPT with W + alpha/r B A in place of each adapted W, by autograd
    A = {m: ours.get_submodule(m).lora_A["default"].weight.detach().clone().requires_grad_()
         for m in mods}
    B = {m: ours.get_submodule(m).lora_B["default"].weight.detach().clone().requires_grad_()
         for m in mods}
    params = dict(base.named_parameters())
    for m in mods:
        params[f"{m}.weight"] = params[f"{m}.weight"] + opts.scaling * B[m] @ A[m]
    want = torch.func.functional_call(base, {**params, **dict(base.named_buffers())}, (x,))
    by_peft = peft(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, by_peft, atol=1e-5, rtol=0)
    w = torch.randn_like(got)
    for out in (got, want, by_peft):
        (out * w).sum().backward()
    for m in mods:
        layer = ours.get_submodule(m)
        for ab, ref in (("lora_A", A[m]), ("lora_B", B[m])):
            mine_g = getattr(layer, ab)["default"].weight.grad
            assert ref.grad.abs().max() > 0
            for other in (ref.grad, theirs[f"{m}.{ab}.default.weight"].grad):
                torch.testing.assert_close(mine_g, other, atol=1e-5, rtol=RTOL,
                                           msg=lambda s, m=m, ab=ab: f"{m}.{ab}: {s}")
    assert all(p.grad is None for n, p in ours.named_parameters() if not is_adapter(n))


@pytest.mark.parametrize("name", ["gpt-tiny", "hf-llama-tiny"])
def test_bf16_frozen_linear_storage_is_exact_under_autocast(name):
    """--precision bf16 stores the frozen Linear weights in bf16 (Job: store_frozen_linear):
    the same logits bit for bit, embeddings and norms kept in fp32."""
    torch.manual_seed(0)
    m = models.build(name, VOCAB, SEQ)
    apply_lora(m, LoraOptions(rank=4))
    _random_b(m)
    stored = copy.deepcopy(m)
    assert store_frozen_linear(stored, torch.bfloat16) > 0
    for n, p in stored.named_parameters():
        bf16 = p.dtype == torch.bfloat16
        assert bf16 == (not p.requires_grad and (".base_layer." in n or "lm_head" in n)), n
    autocast_layers(m, "cpu", torch.bfloat16)
    autocast_layers(stored, "cpu", torch.bfloat16)
    x = torch.randint(0, VOCAB, (2, SEQ))
    assert torch.equal(m(x), stored(x))


TINY = ["--model", "gpt-tiny", "--steps", "2", "--batch", "4", "--seq", "32", "--no-plot"]


@pytest.mark.parametrize("flags,message", [
    (["--lora", "4", "--lora-targets", "q_proj"],
     "--lora-targets q_proj: LoRA target 'q_proj' names no nn.Linear module of GPT; its Linear "
     "modules are named fc, lm_head, proj, qkv"),
    (["--model", "hf-llama-tiny", "--lora", "4", "--lora-targets", "q_proj,qkv"],
     "--lora-targets q_proj,qkv: LoRA target 'qkv' names no nn.Linear module of LlamaForCausalLM;"
     " its Linear modules are named down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj"),
    (["--lora", "-1"], "--lora must be >= 1 (the adapter rank; 0: off), got -1"),
    (["--lora", "4", "--lora-alpha", "-2"], "--lora-alpha must be > 0"),
    (["--lora", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0 (the update's scale is "
                                           "alpha / R; omitted: 2 R), got 0.0"),
    (["--lora", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1.0"),
    (["--lora", "4", "--lora-dropout", "-0.1"], "--lora-dropout must be in [0, 1), got -0.1"),
    (["--lora", "4", "--lora-targets", ","], "--lora-targets ',': no module name given"),
    (["--base-dtype", "bf16"], "--base-dtype bf16: the base is frozen only under LoRA adapters;"
                               " add --lora R"),
    (["--base-placement", "shard"], "--base-placement shard: the base is frozen only under LoRA"),
    (["--lora-targets", "q_proj"], "--lora-targets q_proj without --lora R"),
    (["--lora-alpha", "16", "--lora-dropout", "0.1"],
     "--lora-alpha 16.0, --lora-dropout 0.1 without --lora R"),
])
def test_bad_lora_flags_fail_before_any_rank_starts(tmp_path, capsys, flags, message):
    assert main(TINY + ["--out", str(tmp_path)] + flags) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def _record(**flags):
    cfg = TrainConfig(model="hf-llama-tiny", **flags)
    return {"config": dataclasses.asdict(cfg), "warmup_steps": cfg.warmup_steps}


@pytest.mark.parametrize("saved,now,message", [
    ({"lora": 4}, {}, "--lora: 4 in the checkpoint, 0 here (the checkpoint holds LoRA adapters "
                      "and their optimizer state only, on a frozen base it does not store: a "
                      "full fine-tune cannot resume from it; resume with --lora 4"),
    ({}, {"lora": 4}, "--lora: 0 in the checkpoint, 4 here (a full fine-tune's checkpoint: "
                      "every weight trained, no adapters to resume"),
    ({"lora": 4}, {"lora": 8}, "--lora: 4 in the checkpoint, 8 here (adapters of rank 4 are "
                               "[4 x features] tensors: rank 8 is another set of adapters; "
                               "resume with --lora 4)"),
    ({"lora": 4}, {"lora": 4, "lora_alpha": 16},
     "--lora-alpha: 2 R (its default) in the checkpoint, 16 here (alpha / rank scales every "
     "adapter update: the adapters trained at scale 2 would mean another update at 4; resume "
     "with --lora-alpha 8)"),
    ({"lora": 4, "lora_targets": "q_proj,v_proj"}, {"lora": 4},
     "--lora-targets: q_proj,v_proj in the checkpoint, all-linear here (the checkpoint's "
     "adapters sit on other modules than these flags would put them on; resume with "
     "--lora-targets q_proj,v_proj)"),
    ({"lora": 4}, {"lora": 4, "base_dtype": "int8"},
     "--base-dtype: none in the checkpoint, int8 here (the frozen base is not in the "
     "checkpoint: a resume rebuilds it, and in another --base-dtype it is another base"),
])
def test_resume_refuses_another_lora_setup_and_says_why(saved, now, message):
    refused, _ = resume_changes(TrainConfig(model="hf-llama-tiny", **now), _record(**saved))
    assert any(message in r for r in refused), refused


def test_resume_takes_an_alpha_given_as_its_default():
    # no --lora-alpha means 2 R: a checkpoint of --lora 4 resumes with --lora-alpha 8
    refused, _ = resume_changes(TrainConfig(model="hf-llama-tiny", lora=4, lora_alpha=8.0),
                                _record(lora=4))
    assert refused == []


# ---------------------------------------------------------------- the job on gloo ranks
STEPS = 4
FLAGS = dict(model="hf-llama-tiny", lora=4, steps=STEPS, batch=4, seq=SEQ, seed=1, lr=3e-3,
             eval_batches=1, tensorboard="off")
MESHES = {"1proc": {}, "dp2": {"dp": 2}, "dp2-zero2": {"dp": 2, "zero": 2}, "pp2": {"pp": 2},
          "dp2-zero3": {"dp": 2, "zero": 3},  # the frozen base as zero 3 places it (auto)
          # two replicas meeting every 2 steps, in bf16 (frozen Linear weights stored in bf16)
          "diloco-bf16": {"diloco": 2, "replicas": 2, "precision": "bf16"}}
# --zero 3 with an int8 base sharded over the 2 ranks (not in MESHES: an int8 base is not one
# rank's fp32 model)
SHARDED = {"dp": 2, "zero": 3, "base_dtype": "int8", "base_placement": "shard"}


def _job(rank, world, kw, first=1, save=(), load=None):
    """The job's own steps first..STEPS on these ranks (Job as pyfast train runs it), saving
    at the steps in `save`, after loading checkpoint `load` if given: (records, this rank's
    trainable parameters, the job's counts, whether every frozen parameter is without .grad,
    {frozen parameter name: dtype}, the job's frozen-base log line)."""
    from pyfast.train.job import Job
    job = Job(TrainConfig(**{**FLAGS, **kw}), torch.device("cpu"))
    try:
        if load is not None:
            assert job.load(load)[0] == first - 1
        recs = []
        for step in range(first, STEPS + 1):
            recs.append(job.train_step(step))
            if step in save:
                job.save(job.cfg.out, step)
        frozen = [p for p in job.model.parameters() if not p.requires_grad]
        mine = {n: p.detach().clone() for n, p in job.named}
        if job.cfg.zero == 3:  # the parameters are freed between steps: the masters, whole
            from pyfast.parallel.zero.checkpoint import full_state_dict
            whole = full_state_dict(job.zero, job.opt)["model"]
            mine = {n: whole[n].detach().clone() for n in mine}
        return (recs, mine,
                (job.n_params, job.n_trainable), all(p.grad is None for p in frozen),
                {n: str(p.dtype) for n, p in job.model.named_parameters() if not p.requires_grad},
                job.frozen_note)
    finally:
        job.close()


# imported once by the forkserver when this module starts it (11 s a rank otherwise, loaded)
PRELOAD = ("transformers.models.llama.modeling_llama", "peft", "pyfast.models.hf",
           "pyfast.train.job")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{mesh: (records of rank 0, every adapter by name, (parameters, trainable))}; 1proc also
    saves step-2 and step-4 checkpoints under out (its TrainConfig.out). The data: a fixed
    text drawn from a seeded generator (the default, the stdlib's, takes 4 s a rank to read;
    pyfast's own sources would change the trajectory, and so the rounding, at every edit)."""
    import random

    from dist_utils import RankPool
    root = tmp_path_factory.mktemp("lora")
    text = root / "text.txt"
    rng = random.Random(0)
    words = ["def", "return", "self", "rank", "tensor", "grad", "step", "loss", "(", ")", ":",
             "=", "+", "\n", "    ", "import", "torch", "lora", "adapter", "base"]
    text.write_text(" ".join(rng.choice(words) for _ in range(40_000)))
    data = {"data": str(text)}
    out = root / "1proc"
    got = {}
    with RankPool(1, preload=PRELOAD) as one, RankPool(2) as two:  # 1proc beside the others
        one.submit(_job, {"out": str(out), **data}, save=(2, 4))
        for name, kw in MESHES.items():
            if name != "1proc":
                got[name] = two.run(_job, {**kw, **data}, timeout=300)
        # an int8 base sharded by zero 3, saved at step 2, then steps 3-4 resumed from that
        # checkpoint with the base replicated instead (test_base_placement_changes_on_resume)
        shard = {**SHARDED, **data, "out": str(root / "shard")}
        got["shard"] = two.run(_job, shard, save=(2,), timeout=300)
        got["replicated"] = two.run(_job, {**shard, "base_placement": "replicate"}, first=3,
                                    load=str(root / "shard" / "checkpoints" / "step-2"),
                                    timeout=300)
        got["1proc"] = one.wait(300)
    res = {}
    for name, ranks in got.items():
        assert all(r[3] for r in ranks), f"{name}: a frozen parameter got a .grad"
        adapters = {n: t for r in ranks for n, t in r[1].items()}  # pp2: the two stages'
        res[name] = (ranks[0][0], adapters, ranks[0][2], ranks[0][4], ranks[0][5])
    res["out"], res["data"], res["shard_out"] = out, data, Path(shard["out"])
    return res


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dp2", "dp2-zero2", "dp2-zero3", "pp2"])
def test_lora_meshes_train_as_one_rank(runs, name):
    (recs, got, *_), (ref_recs, ref, *_) = runs[name], runs["1proc"]
    loss = [r["loss"] for r in recs]
    want = [r["loss"] for r in ref_recs]
    assert max(abs(a - b) / b for a, b in zip(loss, want)) < 1e-5, (loss, want)
    assert sorted(got) == sorted(ref) and len(ref) == 2 * 7 * 2  # 2 layers x 7 Linear x (A, B)
    assert all(is_adapter(n) for n in ref)
    # the meshes sum the gradient in another order (fp32: ~1e-7 relative); AdamW's first steps
    # move an element by ~lr whatever its gradient's size (g / sqrt(v)), so an element whose
    # gradient is near its own rounding noise may move differently: bound by 1e-3 of the
    # largest possible movement, lr x steps = 1.2e-2 (measured: 3e-7 to 4.6e-6 by data)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-3 * FLAGS["lr"] * STEPS, rtol=0,
                                   msg=lambda s, k=k: f"{k}: {s}")
    assert all(ref[k].abs().max() > 0 for k in ref if ".lora_B." in k)  # B has trained


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dp2", "dp2-zero2"])
def test_a_dp_step_sends_adapter_bytes_only(runs, name):
    """bytes_sent (what the summary's "MB sent per step" row shows): a 2-rank all-reduce, or
    reduce-scatter + all-gather, of N fp32 elements sends 2 x 4 N bytes over both ranks, N the
    adapters'; the frozen base (7x the adapters here) would add 2 x 4 x its own."""
    recs, _, (total, n), *_ = runs[name]
    assert n < total / 4
    for r in recs:
        assert 2 * 4 * n <= r["bytes_sent"] < 1.1 * 2 * 4 * n, (r["bytes_sent"], n, total)


def _checkpoint(d):
    """A DCP checkpoint directory, read whole in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = d.parent.parent / f"{d.name}.pt"
    if not out.exists():
        dcp_to_torch_save(d, out)
    return torch.load(out, weights_only=False)


@pytest.mark.dist
def test_checkpoint_holds_adapters_and_their_optimizer_only(runs):
    step2 = runs["out"] / "checkpoints" / "step-2"
    sd = _checkpoint(step2)
    assert sd["model"] and all(is_adapter(k) for k in sd["model"]), sorted(sd["model"])[:4]
    assert sorted(sd["optim"]) == sorted(sd["model"])
    meta = json.loads((step2 / "meta.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targets": "all-linear", "dropout": 0.0}
    assert meta["trainable_params"] == sum(v.numel() for v in sd["model"].values())
    assert meta["trainable_params"] == runs["1proc"][2][1] < meta["n_params"] / 4


@pytest.mark.dist
def test_resume_is_bit_exact(runs):
    """Steps 3-4 from the step-2 checkpoint (a fresh job: the base rebuilt from --model and
    --seed) equal the straight run's, losses and adapters bit for bit."""
    from dist_utils import run_ranks
    out = runs["out"]
    (recs, got, *_), = run_ranks(_job, 1, {"out": str(out.parent / "resumed"),
                                             **runs["data"]}, first=3,
                                   load=str(out / "checkpoints" / "step-2"), timeout=300)
    (ref_recs, ref, *_) = runs["1proc"]
    assert [json.dumps(r["loss"]) for r in recs] == [json.dumps(r["loss"]) for r in ref_recs[2:]]
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.dist
@pytest.mark.parametrize("flags,says", [
    ({"lora": 8}, "--lora: 4 in the checkpoint, 8 here (adapters of rank 4"),
    ({"lora": 0}, "--lora: 4 in the checkpoint, 0 here (the checkpoint holds LoRA adapters"),
    ({"lora_targets": "q_proj,v_proj"}, "--lora-targets: all-linear in the checkpoint, "
                                        "q_proj,v_proj here"),
    ({"lora_alpha": 4.0}, "--lora-alpha: 2 R (its default) in the checkpoint, 4.0 here"),
    ({"base_dtype": "bf16"}, "--base-dtype: none in the checkpoint, bf16 here"),
])
def test_resume_of_the_checkpoint_with_other_lora_flags_is_refused(runs, flags, says):
    from pyfast.train.run import check_resume
    out = runs["out"]
    meta = json.loads((out / "checkpoints" / "step-4" / "meta.json").read_text())
    cfg = TrainConfig(**{**FLAGS, **runs["data"], "out": str(out), "resume": True, **flags})
    with pytest.raises(ConfigError, match="--resume: .* was written by another run") as e:
        check_resume(cfg, restarted=False, say=None, data=meta["data"])
    assert says in str(e.value)


@pytest.mark.dist
def test_diloco_bf16_syncs_the_adapters_only_and_stores_the_frozen_linears_in_bf16(runs):
    """--diloco 2 --replicas 2: the outer all-reduce at each meeting (steps 2, 4) carries the
    adapters' fp32 pseudo-gradients (outer_payload_bytes: 4 N bytes, N the adapters'; what the
    rank wrote for it, outer_bytes, within 10% of that), not the base's. --precision bf16: the
    frozen Linear weights are bf16, the embedding and the norms fp32 (store_frozen_linear)."""
    recs, adapters, (total, n), dtypes, _ = runs["diloco-bf16"]
    assert [r["outer_payload_bytes"] for r in recs] == [0, 4 * n, 0, 4 * n]
    assert all(4 * n <= r["outer_bytes"] < 1.1 * 4 * n for r in recs[1::2]), recs
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert sorted(adapters) == sorted(runs["1proc"][1])
    for name, dtype in dtypes.items():
        linear = ".base_layer." in name or "lm_head" in name
        assert dtype == ("torch.bfloat16" if linear else "torch.float32"), (name, dtype)
    assert all(d == "torch.float32" for d in runs["1proc"][3].values())  # fp32: as built



@pytest.mark.dist
def test_base_placement_changes_on_resume(runs):
    """--lora 4 --base-dtype int8 --zero 3 --base-placement shard: the job says where the base
    is, and its checkpoint (which holds no frozen parameter) resumes bit-exact with the base
    replicated instead (pyfast.parallel.zero.frozen; --base-placement may change on resume)."""
    from pyfast.train.run import check_resume
    (recs, *_, note), (again, *_, note2) = runs["shard"], runs["replicated"]
    assert note == "frozen base: sharded int8, 0.1 MB a rank of 0.2 (--base-placement shard)"
    assert note2.startswith("frozen base: replicated int8"), note2
    said = []  # what `pyfast train --resume` warns, checked on the same checkpoint
    cfg = TrainConfig(**{**FLAGS, **SHARDED, **runs["data"], "out": str(runs["shard_out"]),
                         "base_placement": "replicate", "resume": True})
    step, _ = check_resume(cfg, restarted=False, say=said.append)
    assert step == 2 and any("--base-placement" in s for s in said), said
    assert [json.dumps(r["loss"]) for r in again] == [json.dumps(r["loss"]) for r in recs[2:]]
    got, want = runs["replicated"][1], runs["shard"][1]
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # bytes_sent counts the frozen all-gathers: the whole int8 base (0.2 MB) crosses at least
    # once a step over both ranks (forward; the layers again in backward)
    assert recs[-1]["bytes_sent"] > again[-1]["bytes_sent"] + 150_000
