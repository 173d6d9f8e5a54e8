"""Tensor parallelism of LoRA layers (pyfast.parallel.lora_tp) at tp 2 against one rank.

Models: hf-llama-tiny with LoRA on all-linear (q/k/v/gate/up colwise, o/down rowwise, the
vocabulary split in the embedding and head) and gpt-tiny with LoRA on all its linear layers
(qkv colwise_qkv with heads, proj rowwise, fc colwise, proj rowwise); and a toy MLP for what the
models' plans do not use: sequence parallelism (colwise_sp / rowwise_sp), gather_output /
input_is_parallel=False, and a frozen bf16 QuantLinear base. lora_B is re-drawn randn * 0.02
(peft starts it at zero, which would leave A's gradient zero and the test blind to it).

Every rank builds the dense model from one seed, then converts a second copy; adapter gradients
are gathered along their partition_dim (sharded) or taken as they are (replicated: every rank
must hold the whole one, so both ranks' copies are compared). Tolerance fp32 rtol 1e-5, atol
1e-6 (gradient entries ~1e-4..1e-2): tp only reorders fp32 sums (the row layers' partial
products, the adapters' all-reduced gradients); a missing all-reduce or a mis-split shard is off
by the value's own size. The train job (hf-llama-tiny --lora 4, 2 steps): loss and gradient norm
within 1e-5 relative of one process (the norm checks that a replicated adapter counts once).
"""
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import RankPool, run_ranks

# found, not imported: peft (and the transformers it imports) costs ~7 s of a loaded 2-core
# machine, paid once by the ranks' forkserver (PRELOAD below), not also by this process
for _need in ("peft", "transformers"):
    if importlib.util.find_spec(_need) is None:
        pytest.skip(f"LoRA on hf-llama-tiny needs {_need}", allow_module_level=True)
PRELOAD = ["peft", "transformers.models.llama.modeling_llama", "pyfast.parallel.lora_tp",
           "pyfast.train.job"]

SEED, VOCAB, B, T = 7, 256, 2, 16
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, preload=PRELOAD) as p:
        yield p


def _randomize_b(model):
    from pyfast.models.lora import adapter_params
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for n, p in adapter_params(model):
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _lm(name):
    from pyfast import models
    from pyfast.models.lora import LoraOptions, apply_lora
    torch.manual_seed(SEED)
    m = models.build(name, VOCAB, T)
    apply_lora(m, LoraOptions(rank=4, alpha=8))
    _randomize_b(m)
    return m


def _gathered(model):
    """{adapter name: whole gradient} (shards all-gathered along partition_dim)."""
    import torch.distributed as dist
    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
            continue
        g = p.grad.contiguous()
        if p.tensor_parallel:
            parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, g)
            g = torch.cat(parts, p.partition_dim)
        out[n] = g
    return out


def _lm_parity(rank, world, name):
    from pyfast.parallel import parallelize, vocab_parallel_cross_entropy
    from pyfast.parallel.tp_comm import gather_from_tp_region
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(SEED))
    x, y = ids[:, :-1], ids[:, 1:]
    dense = _lm(name)
    logits = dense(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    ref = {n: p.grad for n, p in dense.named_parameters() if p.requires_grad}
    model = _lm(name)
    parallelize(model, model.tp_plan())
    model.retie()
    out = model(x)
    if model.vocab_parallel:
        tp_loss = vocab_parallel_cross_entropy(out, y)
        out = gather_from_tp_region(out.detach())
    else:
        tp_loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    tp_loss.backward()
    marks = {n: (p.tensor_parallel, p.partition_dim) for n, p in model.named_parameters()
             if p.requires_grad}
    return dict(logits=(logits.detach(), out.detach()), loss=(loss.detach(), tp_loss.detach()),
                grads=(ref, _gathered(model)), marks=marks)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["hf-llama-tiny", "gpt-tiny"])
def test_lora_tp2_matches_one_rank(pool, name):
    r0, r1 = pool.run(_lm_parity, name)
    for r in (r0, r1):
        torch.testing.assert_close(r["logits"][1], r["logits"][0], **TOL)
        torch.testing.assert_close(r["loss"][1], r["loss"][0], **TOL)
        ref, got = r["grads"]
        assert set(got) == set(ref) and len(ref) > 0
        for n in ref:
            assert ref[n].abs().max() > 0, n  # random B: no adapter gradient is trivially 0
            torch.testing.assert_close(got[n], ref[n], **TOL, msg=n)
    # column layers: A whole, B's rows split; row layers: A's columns split, B whole
    rows = ("o_proj", "down_proj", "attn.proj", "mlp.proj")
    for n, mark in r0["marks"].items():
        row, a = any(f"{k}.lora_" in n for k in rows), ".lora_A." in n
        if row:
            assert mark == ((True, 1) if a else (False, None)), (n, mark)
        else:
            assert mark == ((False, None) if a else (True, 0)), (n, mark)


class MLP(nn.Module):
    """[s, b, d] -> fc1 -> GELU -> fc2: the sequence-parallel layout (sequence_dim 0)."""

    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _mlp(base_dtype=None):
    from pyfast.models.lora import LoraOptions, apply_lora
    from pyfast.models.quant_base import quantize_base
    torch.manual_seed(SEED)
    m = apply_lora(MLP(), LoraOptions(rank=4, targets="fc1,fc2"))
    _randomize_b(m)
    if base_dtype:
        quantize_base(m, base_dtype)
    return m


MLP_PLANS = {
    "tp": {"fc1": "colwise", "fc2": "rowwise"},
    "sp": {"fc1": "colwise_sp", "fc2": "rowwise_sp"},
    # fc1 returns the whole output and fc2 scatters it: the adapters gather / scatter alike
    "gather-scatter": {"fc1": ("colwise", {"gather_output": True}),
                       "fc2": ("rowwise", {"input_is_parallel": False})},
    "bf16-base": {"fc1": "colwise", "fc2": "rowwise"},
    "bf16-base-sp": {"fc1": "colwise_sp", "fc2": "rowwise_sp"},
}


def _mlp_parity(rank, world, case):
    import torch.distributed as dist

    from pyfast.parallel import parallelize
    base = "bf16" if case.startswith("bf16") else None
    sp = case.endswith("sp")
    g = torch.Generator().manual_seed(SEED)
    x, gy = torch.randn(8, 3, 16, generator=g), torch.randn(8, 3, 16, generator=g)
    dense = _mlp(base)
    xd = x.clone().requires_grad_()
    y = dense(xd)
    y.backward(gy)
    ref = {n: p.grad for n, p in dense.named_parameters() if p.requires_grad}
    model = parallelize(_mlp(base), MLP_PLANS[case])
    mine = x.chunk(world)[rank] if sp else x
    xt = mine.clone().requires_grad_()
    out = model(xt)
    out.backward(gy.chunk(world)[rank] if sp else gy)
    if sp:  # this rank's slice of the sequence: whole ones for the parent
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.detach().contiguous())
        out = torch.cat(parts)
        parts = [torch.empty_like(xt.grad) for _ in range(world)]
        dist.all_gather(parts, xt.grad)
        xg = torch.cat(parts)
    else:
        xg = xt.grad
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    merged = None
    if case == "tp":  # peft's merge on the shards: B shard @ A (column), B @ A shard (row)
        with torch.no_grad():
            model.fc1.merge()
            model.fc2.merge()
            assert model.fc1.merged and model.fc2.merged  # forward now skips the adapters
            merged = (out.detach(), model(x))
    return dict(merged=merged, y=(y.detach(), out.detach()), xgrad=(xd.grad, xg),
                grads=(ref, _gathered(model)), kinds=kinds)


@pytest.mark.dist
@pytest.mark.parametrize("case", list(MLP_PLANS))
def test_lora_tp2_mlp_styles(pool, case):
    for r in pool.run(_mlp_parity, case):
        torch.testing.assert_close(r["y"][1], r["y"][0], **TOL)
        torch.testing.assert_close(r["xgrad"][1], r["xgrad"][0], **TOL)
        ref, got = r["grads"]
        assert set(got) == set(ref) == {f"fc{i}.lora_{ab}.default.weight" for i in (1, 2)
                                        for ab in "AB"}
        for n in ref:
            assert ref[n].abs().max() > 0, n
            torch.testing.assert_close(got[n], ref[n], **TOL, msg=n)
        if r["merged"] is not None:
            torch.testing.assert_close(r["merged"][1], r["merged"][0], **TOL)
        if case.startswith("bf16"):
            assert r["kinds"]["fc1.base_layer"] == "QuantColumnParallelLinear"
            assert r["kinds"]["fc2.base_layer"] == "QuantRowParallelLinear"


def _refusals(rank, world):
    from dist_utils import value_error_text
    from pyfast.parallel import parallelize
    return {"int8": value_error_text(lambda: parallelize(_mlp("int8"), MLP_PLANS["tp"])),
            "vocab": value_error_text(lambda: parallelize(_mlp(), {"fc1": "vocab"}))}


@pytest.mark.dist
def test_lora_tp_refuses_a_quantized_base_it_cannot_split(pool):
    for r in pool.run(_refusals):
        assert "'fc1' (colwise)" in r["int8"] and "QuantLinear stored int8" in r["int8"] \
            and "--base-dtype bf16" in r["int8"], r["int8"]
        assert "is a Linear, which style 'vocab' cannot shard" in r["vocab"], r["vocab"]


def _train(rank, world, flags):
    import torch.distributed as dist

    from pyfast.train.config import from_args, parser
    from pyfast.train.job import Job
    argv = ["--model", "hf-llama-tiny", "--lora", "4", "--steps", "2", "--batch", "2",
            "--seq", "32", "--seed", "3", "--out", "/nonexistent-unused", *flags]
    job = Job(from_args(parser().parse_args(argv)), torch.device("cpu"))
    try:
        return [job.train_step(s) for s in (1, 2)]
    finally:
        job.close()
        dist.barrier()


@pytest.mark.dist
def test_train_tp2_lora_matches_one_process(pool):
    one = run_ranks(_train, 1, [])[0]
    two = pool.run(_train, ["--tp", "2"])
    for recs in two:
        for a, b in zip(recs, one):
            for k in ("loss", "grad_norm"):
                assert abs(a[k] - b[k]) <= 1e-5 * abs(b[k]), (k, a, b)


def test_quantized_base_with_tp_fails_before_any_rank_starts(tmp_path, capsys):
    from pyfast.train import main
    argv = ["--model", "hf-llama-tiny", "--lora", "4", "--base-dtype", "int8", "--tp", "2",
            "--steps", "2", "--batch", "2", "--seq", "32", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--base-dtype int8 with --tp 2" in err and "use --base-dtype bf16" in err, err
