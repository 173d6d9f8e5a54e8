"""Context and pipeline parallelism for Hugging Face causal LMs (pyfast.models.hf_attention,
pyfast.models.hf_stages) against the same model on one process, on tiny configs written here:
a Llama with grouped-query attention (4 query heads, 2 key/value heads, 3 layers: the 5
modules of its Sequential form split unevenly over 2 stages) and a GPT-2 (learned positions),
both untied, with a vocabulary of 250 (no power of two).

cp: every rank builds the dense model and the cp model from one seed; its logits are its shard
of the dense logits (zigzag or contiguous), and the mean over the ranks of each rank's
gradient of its shard's mean loss is the dense gradient of the whole batch's mean loss.
pp: Pipeline.from_sequential(model.as_sequential()) on 2 ranks: the last stage's loss is the
dense loss, and each rank's parameters (by HF's names) have the dense gradients.

Tolerances (those of tests/test_models.py, same sizes): fp32 rtol 1e-5 with atol 1e-6 for
logits (|logit| <~ 1) and 3e-7 for gradients (entries 1e-4..1e-2): the ring merges attention
blocks by log-sum-exp and the pipeline sums micro-batch gradients, which only reorders fp32
sums; a wrong position, a missing key block or a wrong stage input is off by the value's own
size. The train jobs (hf-llama-tiny, 3 steps): 1e-5 relative on each step's loss and gradient
norm, as tests/test_train_cp.py.
"""
import shutil

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="HF models need transformers")

SEED, B, T, VOCAB = 4321, 6, 12, 250  # T: 4 zigzag chunks of 3 on 2 ranks
ACT_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=3e-7)


def _model(arch: str, tie: bool = False, **extra):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from pyfast.models.hf import LLAMA_TP_FIELDS, LLAMA_TP_PLAN, HFCausalLM
    transformers.logging.set_verbosity_error()
    if arch == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                             max_position_embeddings=T, use_cache=False, pad_token_id=None,
                             tie_word_embeddings=tie, attn_implementation="sdpa", **extra)
        return HFCausalLM(LlamaForCausalLM(config), LLAMA_TP_PLAN, LLAMA_TP_FIELDS)
    config = GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=3, n_head=4, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie,
                        attn_implementation="sdpa", **extra)
    return HFCausalLM(GPT2LMHeadModel(config), {}, ())


# the Llama shape for the other Llama-family classes (Mistral, Qwen2, Qwen3)
MISTRAL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=96, use_cache=False,
               tie_word_embeddings=False, attn_implementation="sdpa")


def _batch():
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(SEED))
    return ids[:, :-1], ids[:, 1:]  # the same batch on every rank


def _ce(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _two(arch, **extra):
    torch.manual_seed(SEED)
    dense = _model(arch, **extra)
    torch.manual_seed(SEED)
    return dense, _model(arch, **extra)


# ---------------------------------------------------------------- context parallelism
def _cp_case(rank, world, arch, layout, method):
    import torch.distributed as dist

    from pyfast.parallel.context import shard_sequence
    dense, cp = _two(arch)
    cp.context_parallel(None, layout=layout, method=method)
    x, y = _batch()
    want = dense(x)
    _ce(want, y).backward()
    xs, ys = (shard_sequence(t, dim=1, layout=layout) for t in (x, y))
    got = cp(xs)
    case = f"{arch} {layout} {method}, rank {rank}"
    torch.testing.assert_close(got, shard_sequence(want, dim=1, layout=layout), **ACT_TOL,
                               msg=lambda m: f"{case}: logits: {m}")
    _ce(got, ys).backward()  # this shard's mean loss
    named = dict(dense.named_parameters())
    for name, p in cp.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g / world, named[name].grad, **GRAD_TOL,
                                   msg=lambda m: f"{case}: grad of {name}: {m}")
    return case.split(",")[0]


def _cp_cases(rank, world):
    done = [_cp_case(rank, world, arch, layout, method)
            for arch in ("llama", "gpt2")
            for layout, method in (("zigzag", "ring"), ("contiguous", "ulysses"))]
    errors = []
    # GPT-2's learned table holds 16 positions: 2 ranks x 10 tokens do not fit
    torch.manual_seed(SEED)
    m = _model("gpt2")
    m.context_parallel(None, layout="zigzag")
    for make in (lambda: m(torch.randint(0, VOCAB, (1, 10))),
                 lambda: m.context_parallel(None, layout=None)):
        try:
            make()
        except ValueError as e:
            errors.append(str(e))
    # attention dropout is refused, not dropped; a sliding window narrower than the sequence
    # (Mistral's, 5 tokens) too
    from transformers import MistralConfig, MistralForCausalLM

    from pyfast.models.hf import HFCausalLM
    torch.manual_seed(SEED)
    mistral = HFCausalLM(MistralForCausalLM(MistralConfig(**MISTRAL, sliding_window=5)), {}, ())
    mistral.context_parallel(None, layout="contiguous")
    for make in (lambda: _model("llama", attention_dropout=0.1).context_parallel(
                     None, layout="zigzag"),
                 lambda: mistral(torch.randint(0, VOCAB, (1, 8)))):
        try:
            make()
        except ValueError as e:
            errors.append(str(e))
    return done, errors


@pytest.mark.dist
def test_cp2_matches_one_process(pool2):
    results = pool2.run(_cp_cases)
    assert results[0] == results[1]
    done, errors = results[0]
    assert done == ["llama zigzag ring", "llama contiguous ulysses", "gpt2 zigzag ring",
                    "gpt2 contiguous ulysses"]
    assert len(errors) == 4, errors
    assert errors[0] == ("sequence of 20 tokens (10 on each of 2 context-parallel ranks) is "
                         "longer than the model's 16 learned positions")
    assert "layout must be one of" in errors[1]
    assert "LlamaConfig has attention dropout 0.1" in errors[2]
    assert "sliding-window attention (5 tokens, in a sequence of 16)" in errors[3]


# ---------------------------------------------------------------- pipeline parallelism
def _pp_case(rank, world, arch, schedule):
    from pyfast.parallel import Pipeline
    dense, owner = _two(arch)
    x, y = _batch()
    want = _ce(dense(x), y)
    want.backward()
    stages = owner.as_sequential()
    pipe = Pipeline.from_sequential(stages, n_microbatches=3, schedule=schedule, loss_fn=_ce)
    loss = pipe.step(x, y)
    case = f"{arch} {schedule}, rank {rank}"
    if loss is not None:
        torch.testing.assert_close(loss, want, **ACT_TOL, msg=lambda m: f"{case}: loss: {m}")
    named, mine = dict(dense.named_parameters()), []
    for name, p in stages.named_parameters():  # HF's names: the dense model's
        if p.device.type == "meta":  # another stage's
            continue
        torch.testing.assert_close(p.grad, named[name].grad, **GRAD_TOL,
                                   msg=lambda m: f"{case}: grad of {name}: {m}")
        mine.append(name)
    return loss is not None, sorted(mine)


def _pp_cases(rank, world):
    return [_pp_case(rank, world, arch, schedule)
            for arch, schedule in (("llama", "1f1b"), ("llama", "gpipe"), ("gpt2", "1f1b"))]


@pytest.mark.dist
def test_pp2_matches_one_process(pool2):
    results = pool2.run(_pp_cases)
    for case, arch in enumerate(("llama", "llama", "gpt2")):
        (last0, names0), (last1, names1) = results[0][case], results[1][case]
        assert (last0, last1) == (False, True)
        every = {n for n, _ in _model(arch).named_parameters()}
        # every parameter checked once, on the rank holding its stage
        assert not set(names0) & set(names1) and set(names0) | set(names1) == every
        head = "hf.lm_head.weight"
        assert head in names1 and any(".embed_tokens." in n or ".wte." in n for n in names0)


def _tp_stages(rank, world):
    """parallelize() on the Sequential form (as the job runs tp x pp): the plan resolves to the
    stages' names, retie() hands the converted modules back to the HF model."""
    from pyfast.parallel import parallelize
    from pyfast.parallel.tensor import ColumnParallelLinear
    from pyfast.parallel.vocab import VocabParallelEmbedding
    dense, owner = _two("llama")
    stages = owner.as_sequential()
    parallelize(stages, stages.tp_plan())
    stages.retie()
    hf = owner.hf
    assert isinstance(hf.model.embed_tokens, VocabParallelEmbedding)
    assert isinstance(hf.model.layers[2].self_attn.q_proj, ColumnParallelLinear)
    assert isinstance(hf.lm_head, ColumnParallelLinear)
    x, _ = _batch()
    torch.testing.assert_close(stages(x), dense(x).chunk(world, -1)[rank], **ACT_TOL)
    return sorted(n for n, _ in stages.named_parameters()) == \
        sorted(n for n, _ in dense.named_parameters())


@pytest.mark.dist
def test_tp2_on_the_stages_shares_modules_with_the_hf_model(pool2):
    assert pool2.run(_tp_stages) == [True, True]


def test_stages_keep_hf_names_and_refuse_tied_embeddings():
    torch.manual_seed(SEED)
    m = _model("llama")
    stages = m.as_sequential()
    assert len(stages) == 5  # embedding, 3 layers, head
    assert [(n, id(p)) for n, p in stages.named_parameters()] == \
        [(n, id(p)) for n, p in m.named_parameters()]
    assert next(iter(dict(stages.named_parameters()))) == "hf.model.embed_tokens.weight"
    assert stages.state_dict().keys() == m.state_dict().keys()
    x, _ = _batch()
    # the same modules and kernels in the same order: the same bits
    torch.testing.assert_close(stages(x), m(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="ties its input embedding and LM head"):
        _model("gpt2", tie=True).as_sequential()
    from transformers import GemmaConfig, GemmaForCausalLM

    from pyfast.models.hf import HFCausalLM
    gemma = HFCausalLM(GemmaForCausalLM(GemmaConfig(**MISTRAL, head_dim=16)), {}, ())
    with pytest.raises(ValueError, match="model_type 'gemma'.*supported model types are llama"):
        gemma.as_sequential()


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_stages_of_other_llama_family_models_equal_their_forward(arch):
    """Sliding windows (5 of 12 tokens: Mistral's on every layer, Qwen2's on the layers past
    max_window_layers) and Qwen3's q/k norms go through the stages as through HF's forward."""
    import transformers

    from pyfast.models.hf import HFCausalLM
    shape = {"mistral": dict(sliding_window=5),
             "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
             "qwen3": {}}[arch]
    config = getattr(transformers, f"{arch.capitalize()}Config")(**MISTRAL, **shape)
    m = HFCausalLM(getattr(transformers, f"{arch.capitalize()}ForCausalLM")(config), {}, ())
    x, _ = _batch()
    torch.testing.assert_close(m.as_sequential()(x), m(x), rtol=0, atol=0)


# ---------------------------------------------------------------- pyfast train
HF = ["--model", "hf-llama-tiny"]
JOBS = {"1proc": (1, HF), "cp2": (2, HF + ["--cp", "2"]), "pp2": (2, HF + ["--pp", "2"]),
        "tp2": (2, HF + ["--tp", "2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_train import shared_runs
    return shared_runs(tmp_path_factory, JOBS)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["cp2", "pp2", "tp2"])
def test_train_hf_llama_matches_one_process(runs, name):
    from test_train import records, rel
    got, ref = records(runs[name]), records(runs["1proc"])
    assert len(got) == len(ref) == 3
    for key in ("loss", "grad_norm"):
        assert rel([r[key] for r in got], [r[key] for r in ref]) < 1e-5, (key, got, ref)
    # validation (the pipeline's forward; cp shards) after steps 2 and 3
    assert rel([r["val_loss"] for r in got[1:]], [r["val_loss"] for r in ref[1:]]) < 1e-5


@pytest.mark.dist
def test_train_hf_pp2_checkpoint_resumes_on_one_process(runs, tmp_path):
    """HF's parameter names whatever the mesh: a pp=2 checkpoint loads at pp=1."""
    from test_train import pool_train, records, rel
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(runs["pp2"] / "checkpoints" / "step-2")).read_metadata()
    assert "model.hf.model.layers.1.self_attn.q_proj.weight" in keys.state_dict_metadata
    src = tmp_path / "pp2"
    shutil.copytree(runs["pp2"], src)
    shutil.rmtree(src / "checkpoints" / "step-3")
    lines = (src / "metrics.jsonl").read_text().splitlines(keepends=True)
    (src / "metrics.jsonl").write_text("".join(lines[:2]))  # step 3 must come from the resume
    p = pool_train(src, 1, HF + ["--resume"])  # one process: the job on a forked rank
    assert "another mesh" in p.stdout
    got, ref = records(src), records(runs["1proc"])
    assert got[-1]["step"] == 3
    assert rel([got[-1]["loss"]], [ref[-1]["loss"]]) < 1e-5, (got, ref)


@pytest.mark.parametrize("flags, message", [
    (["--pp", "3", "--batch", "12"], "--pp 3: more pipeline stages than the 2 transformer layers"),
    (["--pp", "2", "--tie-embeddings"], "ties its input embedding and LM head"),
    (["--cp", "8", "--cp-method", "ulysses", "--seq", "32"],
     "each tp rank holds 4 heads (n_head 4 / --tp 1), not divisible by 8"),
])
def test_bad_hf_flags_fail_before_any_rank_starts(tmp_path, capsys, flags, message):
    from pyfast.train import main
    argv = ["--model", "hf-llama-tiny", "--steps", "2", "--batch", "8", "--seq", "32"]
    assert main(argv + ["--out", str(tmp_path)] + flags) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "metrics.jsonl").exists()
