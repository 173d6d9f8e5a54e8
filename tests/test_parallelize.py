"""parallelize() on a small GPT at 2 and 4 gloo ranks against the dense model.

Every rank builds the same dense model and data from fixed seeds, converts it with a plan and
runs forward and backward; sharded gradients are gathered along the dimension their parameter
says (`partition_dim`) so the parent compares the whole of every gradient with the dense one.
One spawn per world size runs every case.

Tolerance fp32 rtol 1e-5, atol 1e-5: the row layers' outputs are partial sums added in another
order than the dense GEMM's (a few ulps), and two blocks of attention, GELU and LayerNorm carry
that forward and back; atol covers entries near zero.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks, value_error_text

D, HEADS, HIDDEN, LAYERS = 24, 4, 96, 2  # head_dim 6; 4 heads split over 2 or 4 ranks
B, T = 3, 8
TOL = dict(rtol=1e-5, atol=1e-5)
PLAN = {"layers.*.attn.qkv": "colwise", "layers.*.attn.proj": "rowwise",
        "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}
SP_PLAN = {k: v + "_sp" for k, v in PLAN.items()}


class Attention(nn.Module):
    """Causal self-attention. qkv's output features are laid out head by head ([heads, 3,
    head_dim]) and the number of heads is read off the activation (view(B, T, -1, 3, hd)),
    never stored: so a colwise qkv holds whole heads, each with its q, k and v, and the same
    code runs a rank's heads/tp heads. That is what makes the block TP-convertible; nanoGPT's
    [3, heads, head_dim] layout (qkv.split(n_embd)) would need its weight permuted first."""

    def __init__(self, d, heads):
        super().__init__()
        self.head_dim = d // heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]  # sequence parallel: t is the whole sequence, x holds a slice
        q, k, v = qkv.view(b, t, -1, 3, self.head_dim).transpose(1, 2).unbind(3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d, heads, hidden):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=0):
        super().__init__()
        self.wte = nn.Embedding(vocab, D) if vocab else None
        self.layers = nn.ModuleList(Block(D, HEADS, HIDDEN) for _ in range(LAYERS))

    def forward(self, x):
        x = self.wte(x) if self.wte is not None else x
        for layer in self.layers:
            x = layer(x)
        return x


def _dense(vocab=0):
    torch.manual_seed(0)
    model = GPT(vocab)
    for p in model.parameters():  # LayerNorm starts at (1, 0): make its gradients tell
        if p.dim() == 1:
            nn.init.normal_(p, 0.5 if p is model.layers[0].ln1.weight else 0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (B, T), generator=g) if vocab else torch.randn(B, T, D, generator=g)
    return model, x, torch.randn(B, T, D, generator=g)


def _run(model, x, gy):
    x = x.clone().requires_grad_(x.is_floating_point())
    y = model(x)
    y.backward(gy)
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _full_grads(model, sp: bool):
    """Every gradient whole: shards gathered along partition_dim; with sequence parallelism a
    LayerNorm saw only this rank's tokens, so its gradient is partial and summed here (Megatron
    all-reduces these over TP after backward; parallelize swaps Linear layers only)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    norms = {f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)
             for k, _ in m.named_parameters()}
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.contiguous()
        if getattr(p, "tensor_parallel", False):
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            g = torch.cat(parts, p.partition_dim)
        elif sp and n in norms:
            g = g.clone()
            dist.all_reduce(g)
        out[n] = g
    return out


def _worker(rank, world):
    from pyfast.parallel import ColumnParallelLinear, RowParallelLinear, parallelize
    out = {}
    model, x, gy = _dense()
    names = [n for n, _ in model.named_parameters()]

    m = parallelize(model, PLAN)
    assert isinstance(m.layers[1].attn.qkv, ColumnParallelLinear)
    assert isinstance(m.layers[1].mlp.fc2, RowParallelLinear)
    assert [n for n, _ in m.named_parameters()] == names  # state-dict keys unchanged
    y, xg, _ = _run(m, x, gy)
    out["tp"] = (y, xg, _full_grads(m, sp=False))

    model, x, gy = _dense()
    m = parallelize(model, SP_PLAN, sequence_dim=1)
    y, xg, _ = _run(m, x.chunk(world, 1)[rank], gy.chunk(world, 1)[rank])
    out["sp"] = (y, xg, _full_grads(m, sp=True))

    # the sequence-parallel regions by style, as GPT.tp_plan(sequence_parallel=True) names
    # them: whole ids in, whole output out, norm gradients summed over tp by parallelize's hooks
    model, x, gy = _dense(vocab=40)
    m = parallelize(model, {**SP_PLAN, "layers.*.ln*": "sequence_norm", "wte": "sequence_scatter",
                            f"layers.{LAYERS - 1}": "sequence_gather"}, sequence_dim=1)
    marked = sorted(n for n, p in m.named_parameters() if getattr(p, "sequence_parallel", False))
    y, _, _ = _run(m, x, gy)
    out["sp_styles"] = (y, _full_grads(m, sp=False), marked)

    model, x, gy = _dense()
    alias = {k: {"colwise": "ColwiseParallel", "rowwise": "row"}[v] for k, v in PLAN.items()}
    y, _, _ = _run(parallelize(model, alias), x, gy)
    out["alias"] = y

    model, x, gy = _dense(vocab=40)
    m = parallelize(model, {"wte": "vocab", **PLAN})
    y, _, _ = _run(m, x, gy)
    out["vocab"] = (y, _full_grads(m, sp=False))

    model = _dense()[0]
    odd = nn.Sequential(nn.Linear(D, 2 * world + 1), nn.Linear(2 * world + 1, D))
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
    out["errors"] = {
        "no match": (value_error_text(lambda: parallelize(model, {"layers.*.fc1": "colwise"})),
                     ["'layers.*.fc1'", "GPT"]),
        "conv": (value_error_text(lambda: parallelize(conv, {"0": "colwise"})), ["'0'", "Conv2d"]),
        "layernorm": (value_error_text(
            lambda: parallelize(model, {**PLAN, "layers.0.ln1": "rowwise"})),
                      ["'layers.0.ln1'", "LayerNorm"]),
        "style": (value_error_text(lambda: parallelize(model, {"layers.*.mlp.fc1": "diagonal"})),
                  ["'layers.*.mlp.fc1'", "'diagonal'", "colwise"]),
        "conflict": (value_error_text(lambda: parallelize(model, {"layers.*.mlp.fc1": "colwise",
                                                        "layers.0.mlp.*": "rowwise"})),
                     ["'layers.0.mlp.fc1'", "'layers.*.mlp.fc1'", "'layers.0.mlp.*'"]),
        "divisible": (value_error_text(lambda: parallelize(odd, {"0": "colwise", "1": "rowwise"})),
                      [f"ColumnParallelLinear(in_features={D}, out_features={2 * world + 1})"]),
    }
    # failed plans leave the model as it was
    out["untouched"] = (all(type(mod) is not ColumnParallelLinear for mod in model.modules())
                        and type(odd[0]) is nn.Linear)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, run_ranks(_worker, request.param)


def _compare(got_grads, want_grads):
    assert got_grads.keys() == want_grads.keys()
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("case", ["tp", "sp"])
def test_gpt_matches_dense(ranks, case):
    world, res = ranks
    model, x, gy = _dense()
    y, xg, grads = _run(model, x, gy)
    for r, o in enumerate(res):
        got_y, got_xg, got_grads = o[case]
        want = (y, xg) if case == "tp" else (y.chunk(world, 1)[r], xg.chunk(world, 1)[r])
        torch.testing.assert_close(got_y, want[0], **TOL)
        torch.testing.assert_close(got_xg, want[1], **TOL)
        _compare(got_grads, grads)


def test_sequence_parallel_styles_match_dense(ranks):
    """sequence_scatter / sequence_norm / sequence_gather around the *_sp layers: the module
    computes what the dense one does, on every rank, with the LayerNorms' gradients whole."""
    _, res = ranks
    model, x, gy = _dense(vocab=40)
    y, _, grads = _run(model, x, gy)
    norms = sorted(n for n, p in model.named_parameters() if ".ln" in n)
    for got_y, got_grads, marked in (o["sp_styles"] for o in res):
        torch.testing.assert_close(got_y, y, **TOL)
        _compare(got_grads, grads)
        assert marked == norms


def test_aliases(ranks):
    _, res = ranks
    model, x, gy = _dense()
    for o in res:
        torch.testing.assert_close(o["alias"], model(x).detach(), **TOL)


def test_vocab_style(ranks):
    _, res = ranks
    model, x, gy = _dense(vocab=40)
    y, _, grads = _run(model, x, gy)
    for o in res:
        torch.testing.assert_close(o["vocab"][0], y, **TOL)
        _compare(o["vocab"][1], grads)


def test_bad_plans(ranks):
    world, res = ranks
    for o in res:
        for what, (msg, parts) in o["errors"].items():
            for part in parts + [f"tensor-parallel size {world}"]:
                assert part in msg, f"{what}: {part!r} not in {msg!r}"
        assert o["untouched"]


# ------------------------------------------------------------ tied weights, fused QKV (2 ranks)
V = 10  # vocabulary of the tied model: split over 2 ranks


class TiedLM(nn.Module):
    """An embedding and an LM head sharing one weight (GPT-2's tie)."""

    def __init__(self):
        super().__init__()
        self.tok, self.body, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.tok(ids))))


def _tied_data():
    torch.manual_seed(4)
    model = TiedLM()
    g = torch.Generator().manual_seed(5)
    return model, torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _reference_attention(x, wq, wk, wv, bq, bk, bv, proj, heads):
    """Multi-head causal attention from separate q, k, v projections ([head, head_dim] rows)."""
    b, t, _ = x.shape
    q, k, v = (F.linear(x, w, bias).view(b, t, heads, -1).transpose(1, 2)
               for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return proj(y.transpose(1, 2).reshape(b, t, -1))


def _qkv_data():
    from pyfast.models.gpt import Attention as GPTAttention
    from pyfast.models.gpt import GPTConfig
    from pyfast.parallel.parallelize import fuse_qkv
    torch.manual_seed(6)
    w = [torch.randn(D, D) / D ** 0.5 for _ in range(3)]
    bias = [torch.randn(D) for _ in range(3)]
    attn = GPTAttention(GPTConfig(n_layer=1, n_head=HEADS, d_model=D, positions="learned"))
    with torch.no_grad():  # pyfast.models.gpt's attention, its fused qkv built by the rule
        attn.qkv.weight.copy_(fuse_qkv(*w, HEADS))
        attn.qkv.bias.copy_(fuse_qkv(*bias, HEADS))
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(7))
    return attn, x, _reference_attention(x, *w, *bias, attn.proj, HEADS).detach()


def _tie_worker(rank, world):
    import torch.distributed as dist

    from pyfast.parallel import ColumnParallelLinear, parallelize, vocab_parallel_cross_entropy
    out = {}
    model, ids, target = _tied_data()
    m = parallelize(model, {"tok": "vocab", "head": "colwise"})
    loss = vocab_parallel_cross_entropy(m(ids), target)
    loss.backward()
    parts = [torch.empty_like(m.tok.weight.grad) for _ in range(world)]
    dist.all_gather(parts, m.tok.weight.grad)
    out["tied"] = (m.head.weight is m.tok.weight, [n for n, _ in m.named_parameters()],
                   loss.detach(), torch.cat(parts))

    model = _tied_data()[0]
    shared = nn.Linear(D, D)
    twice = nn.ModuleDict({"enc": shared, "dec": shared})
    conv = parallelize(twice, {"enc": "colwise"})
    out["module_twice"] = conv.enc is conv.dec and type(conv.enc) is ColumnParallelLinear
    attn, x, _ = _qkv_data()
    out["errors"] = {
        "head only": (value_error_text(lambda: parallelize(model, {"head": "colwise"})),
                      ["head.weight", "tok.weight", "'head' (colwise)", "'tok' (not in the plan)",
                       "untie"]),
        "tok only": (value_error_text(lambda: parallelize(model, {"tok": "vocab"})),
                     ["'tok' (vocab)", "'head' (not in the plan)", "untie"]),
        "different shards": (
            value_error_text(lambda: parallelize(model, {"tok": "vocab", "head": "rowwise"})),
            ["'tok' (vocab)", "'head' (rowwise)", "shard it differently"]),
        "qkv heads": (value_error_text(lambda: parallelize(
            attn, {"qkv": ("colwise_qkv", {"heads": 2 * world + 1})})),
            ["colwise_qkv", f"out_features {3 * D}"]),
        "qkv no heads": (value_error_text(lambda: parallelize(attn, {"qkv": "colwise_qkv"})),
                         ["colwise_qkv needs heads="]),
        "qkv tp": (value_error_text(lambda: parallelize(
            attn, {"qkv": ("colwise_qkv", {"heads": HEADS, "kv_heads": 1})})),
            ["kv_heads 1 is not divisible by the tensor-parallel size"]),
    }
    out["untouched"] = (type(model.tok) is nn.Embedding and model.head.weight is model.tok.weight
                        and type(attn.qkv) is nn.Linear)

    attn, x, _ = _qkv_data()
    m = parallelize(attn, {"qkv": ("colwise_qkv", {"heads": HEADS}), "proj": "rowwise"})
    out["qkv"] = m(x).detach()
    return out


@pytest.fixture(scope="module")
def tie_ranks():
    return run_ranks(_tie_worker, 2)


def test_tied_weights_stay_tied_and_match_dense(tie_ranks):
    """Embedding 'vocab' + head 'colwise' hold the same rows: one shared shard, whose gradient
    sums both uses, as the dense tied model's does."""
    model, ids, target = _tied_data()
    loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    for o in tie_ranks:
        same, got_names, got_loss, grad = o["tied"]
        assert same and got_names == names
        torch.testing.assert_close(got_loss, loss.detach(), **TOL)
        torch.testing.assert_close(grad, model.tok.weight.grad, **TOL)


def test_a_module_under_two_names_is_converted_once(tie_ranks):
    assert all(o["module_twice"] for o in tie_ranks)


def test_untying_plans_and_bad_fused_qkv_are_refused_naming_both(tie_ranks):
    for o in tie_ranks:
        for what, (msg, parts) in o["errors"].items():
            for part in parts + ["tensor-parallel size 2"] * (what != "qkv no heads"):
                assert part in msg, f"{what}: {part!r} not in {msg!r}"
        assert o["untouched"]


def test_fused_qkv_layout_rule_matches_separate_projections(tie_ranks):
    """fuse_qkv's rows run through pyfast.models.gpt's attention compute multi-head attention
    of the separate q, k, v projections, dense and split over tp by colwise_qkv."""
    attn, x, want = _qkv_data()
    torch.testing.assert_close(attn(x).detach(), want, **TOL)
    for o in tie_ranks:
        torch.testing.assert_close(o["qkv"], want, **TOL)


def test_fuse_qkv_grouped_layout():
    """GQA: rows [kv group, (its heads/kv_heads q heads, k, v), head_dim]."""
    from pyfast.parallel.parallelize import fuse_qkv
    hd, heads, kv = 2, 4, 2
    q = torch.arange(heads * hd).view(-1, 1) + 100
    k, v = torch.arange(kv * hd).view(-1, 1) + 200, torch.arange(kv * hd).view(-1, 1) + 300
    got = fuse_qkv(q, k, v, heads, kv).flatten().tolist()
    assert got == [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    with pytest.raises(ValueError, match="fuse_qkv"):
        fuse_qkv(q, k, v, 3, kv)
