"""The models the job trains (pyfast.models): the reference GPT and the hf-llama-tiny adapter,
dense and at tp=2 on gloo ranks, the way the job runs them: build from a seed, parallelize with
model.tp_plan(), retie(), logits shard -> vocab_parallel_cross_entropy.

Every rank builds the dense model and the TP model from the same seed and checks, for each
case, on every rank: the logits shard is the dense logits' vocabulary slice; the loss is
F.cross_entropy of the dense logits; the attention output before the output projection is the
dense one's slice (rank r holds heads [r*h/tp, (r+1)*h/tp)); every gradient is the dense
gradient's slice along the parameter's `partition_dim` (whole when not `tensor_parallel`).
One pool of 2 ranks serves the whole file (a spawn costs 2-4 s).

Context parallelism (GPT.context_parallel over the 2 ranks): each rank's logits are its shard
of the dense logits, and the mean over the ranks of each rank's gradient of its shard's mean
loss is the dense gradient of the whole sequence's mean loss (what the job's averaging over dp
x cp computes), within the same tolerances: the ring merges blocks by log-sum-exp in another
order than one softmax.

Tolerance fp32 rtol 1e-5 (a few ulps of sums added in another order: row-parallel outputs are
partial sums, the loss sums the vocabulary in two shards, and two blocks carry that forward and
back), with atol 1e-6 for activations (logits up to ~1; seen: 4e-7) and 3e-7 for gradients
(tensors of scale 5e-4..1e-2; seen: 9e-8), which only covers entries near zero: a wrong slice
or head mapping is off by the gradient's own size.
"""
import sys

import pytest
import torch
import torch.nn.functional as F

from dist_utils import RankPool
from pyfast.models import GPT, GPTConfig, build

SEED, B, T, VOCAB = 1234, 3, 13, 250  # odd batch and sequence; 125 vocabulary rows per rank
ACT_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=3e-7)
# gpt-tiny's shape with odd-ish sizes: head_dim 10, MLP 160, learned table longer than T
GPT_SHAPE = dict(n_layer=2, n_head=4, d_model=40, seq_len=16, vocab_size=VOCAB)


def _gpt(positions, tie, vocab_parallel=True):
    return GPT(GPTConfig(**GPT_SHAPE, positions=positions, tie_embeddings=tie,
                         vocab_parallel=vocab_parallel))


def _llama(tie):
    from pyfast.models.hf import llama_tiny
    return llama_tiny(VOCAB, 16, tie_embeddings=tie)


def _capture_input(module, into: list):
    return module.register_forward_pre_hook(lambda m, args: into.append(args[0].detach()))


def _check_tp(rank, world, make, attn_out, case, tied_names):
    """The checks of the module docstring for one model; make() builds it from torch's RNG,
    attn_out(model) is the attention's output projection, tied_names its (embedding, head)."""
    from pyfast.parallel import parallelize, vocab_parallel_cross_entropy
    torch.manual_seed(SEED)
    dense = make()
    torch.manual_seed(SEED)
    tp = make()
    parallelize(tp, tp.tp_plan())
    tp.retie()
    gen = torch.Generator().manual_seed(SEED + 1)  # the same batch on every rank
    ids, target = torch.randint(0, VOCAB, (2, B, T), generator=gen)

    seen_dense, seen_tp = [], []
    _capture_input(attn_out(dense), seen_dense)
    _capture_input(attn_out(tp), seen_tp)
    logits = dense(ids)
    dense_loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    dense_loss.backward()
    shard = tp(ids)
    if tp.vocab_parallel:
        loss = vocab_parallel_cross_entropy(shard.flatten(0, 1), target.flatten())
        want = logits.chunk(world, -1)[rank]
    else:  # embedding and head whole on every rank: the whole logits
        loss, want = F.cross_entropy(shard.flatten(0, 1), target.flatten()), logits
    loss.backward()

    def msg(what):
        return lambda m: f"{case}, rank {rank}: {what}: {m}"

    torch.testing.assert_close(shard, want, **ACT_TOL, msg=msg("logits"))
    torch.testing.assert_close(loss, dense_loss, **ACT_TOL, msg=msg("loss"))
    torch.testing.assert_close(seen_tp[0], seen_dense[0].chunk(world, -1)[rank], **ACT_TOL,
                               msg=msg("attention heads before the output projection"))

    # tied: named_parameters() lists the shared table once, under the embedding's name, and its
    # gradient holds the embedding's and the head's contributions in both models
    params, dense_params = dict(tp.named_parameters()), dict(dense.named_parameters())
    assert params.keys() == dense_params.keys(), (case, params.keys() ^ dense_params.keys())
    sharded = 0
    for name, p in params.items():
        want = dense_params[name].grad
        if getattr(p, "tensor_parallel", False):
            want, sharded = want.chunk(world, p.partition_dim)[rank], sharded + 1
        torch.testing.assert_close(p.grad, want, **GRAD_TOL, msg=msg(f"grad of {name}"))
    assert sharded >= 8, (case, sharded)  # the plan did shard something in every block
    emb, head = (tp.get_submodule(n) for n in tied_names)
    assert getattr(emb.weight, "tensor_parallel", False) == tp.vocab_parallel, case
    assert (head.weight is emb.weight) == (" tied" in case), case  # one Parameter
    return case


def _gpt_cases(rank, world):
    done = []
    for positions in ("rotary", "learned"):
        for tie in (False, True):
            case = f"gpt {positions} {'tied' if tie else 'untied'}"
            done.append(_check_tp(rank, world, lambda: _gpt(positions, tie),
                                  lambda m: m[1].attn.proj, case, ("0.tok", "3.lm_head")))
    # a vocabulary under VOCAB_PARALLEL_MIN stays whole (the default for byte models)
    done.append(_check_tp(rank, world, lambda: _gpt("rotary", True, vocab_parallel=None),
                          lambda m: m[1].attn.proj, "gpt rotary tied, vocab whole",
                          ("0.tok", "3.lm_head")))
    # the fused QKV layout rule: rank r's qkv rows are the dense rows of heads
    # [r*h/tp, (r+1)*h/tp), each head's q, k and v together
    from pyfast.parallel import parallelize
    torch.manual_seed(SEED)
    dense = _gpt("rotary", False)
    torch.manual_seed(SEED)
    tp = _gpt("rotary", False)
    parallelize(tp, tp.tp_plan())
    h, hd, d = 4, 10, 40
    rows = dense[1].attn.qkv.weight.view(h, 3, hd, d)[rank * h // world:(rank + 1) * h // world]
    assert torch.equal(tp[1].attn.qkv.weight, rows.reshape(-1, d))
    return done


def _cp_case(rank, world, positions, layout, method):
    import torch.distributed as dist

    from pyfast.parallel.context import shard_sequence
    torch.manual_seed(SEED)
    dense = _gpt(positions, False)
    torch.manual_seed(SEED)
    cp = _gpt(positions, False)
    cp.context_parallel(None, layout=layout, method=method)
    ids = torch.randint(0, VOCAB, (B, 13), generator=torch.Generator().manual_seed(SEED))
    x, y = ids[:, :-1], ids[:, 1:]  # 12 tokens: 4 chunks of 3 (zigzag), 2 of 6 (contiguous)
    want = dense(x)
    F.cross_entropy(want.flatten(0, 1), y.flatten()).backward()
    xs, ys = (shard_sequence(t, dim=1, layout=layout) for t in (x, y))
    got = cp(xs)
    torch.testing.assert_close(got, shard_sequence(want, dim=1, layout=layout), **ACT_TOL)
    F.cross_entropy(got.flatten(0, 1), ys.flatten()).backward()  # this shard's mean
    for (name, p), (_, q) in zip(cp.named_parameters(), dense.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g / world, q.grad, **GRAD_TOL, msg=lambda m: f"{name}: {m}")
    return f"cp {positions} {layout} {method}"


def _gpt_cp_cases(rank, world):
    done = [_cp_case(rank, world, positions, layout, method)
            for positions, layout, method in (("rotary", "zigzag", "ring"),
                                              ("rotary", "contiguous", "ring"),
                                              ("learned", "zigzag", "ulysses"),
                                              ("learned", "contiguous", "ulysses"))]
    torch.manual_seed(SEED)
    m = _gpt("rotary", False)  # a table of 16 positions: 2 ranks x 10 tokens is too long
    m.context_parallel(None, layout="zigzag")
    try:
        m(torch.zeros(1, 10, dtype=torch.long))
    except ValueError as e:
        done.append(str(e))
    return done


def _llama_cases(rank, world):
    # o_proj's input is every query head's output: equal slices also show that grouped-query
    # attention pairs each local query head with the right local key/value head
    def o_proj(m):
        return m.hf.model.layers[0].self_attn.o_proj

    return [_check_tp(rank, world, lambda: _llama(tie), o_proj,
                      f"hf-llama-tiny {'tied' if tie else 'untied'}",
                      ("hf.model.embed_tokens", "hf.lm_head"))
            for tie in (False, True)]


@pytest.fixture(scope="module")
def ranks():
    with RankPool(2) as pool:
        yield pool


@pytest.mark.dist
def test_gpt_tp2_matches_dense(ranks):
    done = ranks.run(_gpt_cases)
    assert done == [done[0]] * 2 and len(done[0]) == 5


@pytest.mark.dist
def test_gpt_context_parallel_matches_dense(ranks):
    done = ranks.run(_gpt_cp_cases)
    assert len(done[0]) == 5 and len(done[1]) == 5
    assert done[0][-1] == done[1][-1] == ("sequence of 20 tokens (10 on each of 2 "
                                          "context-parallel ranks) is longer than the model's "
                                          "16 rotary positions")


@pytest.mark.dist
def test_hf_llama_tp2_matches_dense(ranks):
    pytest.importorskip("transformers", reason="hf-llama-tiny needs transformers")
    done = ranks.run(_llama_cases)
    assert done == [["hf-llama-tiny untied", "hf-llama-tiny tied"]] * 2


def _saved_tensors(model, ids):
    """Tensors autograd keeps for backward during one forward (fewer when checkpointed)."""
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids)
    return out, count[0]


def _check_checkpointing(make):
    torch.manual_seed(SEED)
    plain = make()
    torch.manual_seed(SEED)
    ckpt = make()
    ckpt.enable_activation_checkpointing()
    ids, target = torch.randint(0, VOCAB, (2, B, T))
    losses, saved = [], []
    for model in (plain, ckpt):
        model.train()  # HF checkpoints in training mode only
        logits, n = _saved_tensors(model, ids)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        losses.append(loss)
        saved.append(n)
    assert saved[1] < saved[0] / 2, saved  # it did recompute the blocks
    # the recompute runs the same kernels on the same inputs: the same bits
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_gpt_activation_checkpointing_same_loss_and_grads():
    _check_checkpointing(lambda: _gpt("rotary", True))


def test_hf_llama_activation_checkpointing_same_loss_and_grads():
    pytest.importorskip("transformers", reason="hf-llama-tiny needs transformers")
    _check_checkpointing(lambda: _llama(False))


def test_gpt_small_size_and_seeded_build():
    def weights():
        torch.manual_seed(SEED)
        return build("gpt-small", 256, 256).state_dict()

    a, b = weights(), weights()
    n = sum(p.numel() for p in build("gpt-small", 256, 256).parameters())
    assert 10e6 <= n <= 20e6, n
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gpt_tp_check_names_the_field():
    tiny = build("gpt-tiny", 256, 16)
    assert tiny.tp_check(1) is None and tiny.tp_check(2) is None and tiny.tp_check(4) is None
    assert tiny.tp_check(3) == "GPTConfig: n_head 4 is not divisible by tp=3"
    three_heads = GPT(GPTConfig(n_layer=1, n_head=3, d_model=24, vocab_size=256,
                                vocab_parallel=True))
    assert three_heads.tp_check(3) == "GPTConfig: vocab_size 256 is not divisible by tp=3"
    # a vocabulary that stays whole need not divide; a large one is split by default
    whole = GPT(GPTConfig(n_layer=1, n_head=3, d_model=24, vocab_size=256))
    assert not whole.vocab_parallel and whole.tp_check(3) is None
    assert GPT(GPTConfig(n_layer=1, n_head=2, d_model=8, vocab_size=50304)).vocab_parallel


def test_hf_llama_tp_check_and_options():
    pytest.importorskip("transformers", reason="hf-llama-tiny needs transformers")
    model = build("hf-llama-tiny", 256, 16)
    assert model.tp_check(2) is None
    assert model.tp_check(4) == "LlamaConfig: num_key_value_heads 2 is not divisible by tp=4"
    assert model.tp_check(3) == "LlamaConfig: num_attention_heads 4 is not divisible by tp=3"
    assert model(torch.randint(0, 256, (B, T))).shape == (B, T, 256)
    with pytest.raises(ValueError, match="rotary positions only"):
        build("hf-llama-tiny", 256, 16, positions="learned")


def test_hf_llama_without_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'pyfast\[hf\]'"):
        build("hf-llama-tiny", 256, 16)


def test_gpt_at_any_shape_by_name():
    """`gpt:layers=L,heads=H,hidden=D[,mlp=R]` is the reference GPT at that shape (the planner
    dry-runs 7B-shaped ones); odd sizes, a non-default MLP ratio, and each bad name refused."""
    from pyfast import models
    m = models.build("gpt:layers=3,heads=6,hidden=96,mlp=2", 257, 40, tie_embeddings=True)
    assert (m.cfg.n_layer, m.cfg.n_head, m.cfg.d_model, m.cfg.mlp_ratio) == (3, 6, 96, 2)
    assert m(torch.randint(0, 257, (2, 40))).shape == (2, 40, 257)
    assert m[-1].lm_head.weight is m[0].tok.weight
    assert models.known("gpt:layers=1,heads=1,hidden=8") and not models.known("gpt-huge")
    for bad, why in [("gpt:layers=2,heads=4", "missing hidden"),
                     ("gpt:layers=2,heads=4,hidden=0", "positive integers"),
                     ("gpt:layers=2,heads=4,hidden=64,depth=3", "'depth=3'"),
                     ("gpt:layers=2,heads=3,hidden=64", "not divisible by n_head")]:
        with pytest.raises(ValueError, match=why):
            models.build(bad, 256, 16)


def test_a_meta_build_is_the_cpu_build_without_torch_dynamo():
    """The launcher's model check builds on meta (train.config._meta_build): the same
    parameters and buffers as on the CPU (names, shapes, dtypes), no init drawn, RoPE's tables
    made on the CPU and moved; and no meta kernel written in Python runs (torch._refs /
    _prims_common: the first such call imports torch._dynamo, 1.1 s of every `pyfast train`
    launch on the 2-core VM)."""
    from pyfast.train.config import TrainConfig, build_model, check_model
    for kw in (dict(model="gpt-tiny"), dict(model="gpt:layers=3,heads=6,hidden=96", pp=2),
               dict(model="gpt-tiny", positions="learned", tie_embeddings=True, lora=4)):
        c = TrainConfig(**kw)
        torch.manual_seed(0)
        cpu = build_model(c, 256, "cpu")
        python_kernels = []

        def seen(frame, event, arg):
            f = frame.f_code.co_filename
            if event == "call" and ("/torch/_refs/" in f or "/torch/_prims_common/" in f):
                python_kernels.append(f"{f}:{frame.f_code.co_name}")
        sys.setprofile(seen)
        try:
            meta = build_model(c, 256, "meta")
            check_model(c)
        finally:
            sys.setprofile(None)
        assert not python_kernels, (kw, python_kernels[:5])
        for a, b in ((cpu.named_parameters(), meta.named_parameters()),
                     (cpu.named_buffers(), meta.named_buffers())):
            a, b = dict(a), dict(b)
            assert a.keys() == b.keys(), kw
            assert all(b[k].is_meta and (a[k].shape, a[k].dtype, a[k].requires_grad) ==
                       (b[k].shape, b[k].dtype, b[k].requires_grad) for k in a), kw
