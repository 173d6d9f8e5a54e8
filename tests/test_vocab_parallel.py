"""VocabParallelEmbedding and vocab_parallel_cross_entropy at 2 and 4 gloo ranks against
nn.Embedding and F.cross_entropy in one process.

Every rank builds the same global tensors from one seed and works on its vocabulary slice; the
parent computes the dense reference and compares each rank's loss and its shard of every
gradient. One spawn per world size runs every case (spawning costs seconds, a case
milliseconds).

Tolerances. Embedding lookups move bits: compared exactly. fp32 sums run in another order
(exp-sums per shard, then all-reduced; gradients summed by gloo): rtol 1e-5, atol 1e-6. bf16
and fp16 logits are compared with F.cross_entropy of the same values upcast to fp32, which is
what vocab_parallel_cross_entropy computes: the loss within rtol 1e-5, the gradient (fp32,
rounded once to the logits' dtype) within one unit in the last place of that dtype (rtol 2^-7
bf16, 2^-10 fp16), since a value that fp32 summation order moves across a rounding boundary
rounds to the neighbouring number (measured at 2 ranks: 2 of 23088 bf16 and 3 of 23088 fp16
gradient elements differ from the reference, each by one unit).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks

V, D = 4 * 37, 12  # 74 or 37 rows per rank: an odd shard at 4 ranks
IGNORE = -100
REDUCTIONS = ("mean", "sum", "none")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP32 = dict(rtol=1e-5, atol=1e-6)
ULP = {torch.float32: FP32, torch.bfloat16: dict(rtol=2 ** -7, atol=1e-6),
       torch.float16: dict(rtol=2 ** -10, atol=1e-6)}


def _targets(shape, g, ignore_index=IGNORE):
    t = torch.randint(0, V, shape, generator=g)
    t = t.masked_fill(torch.rand(shape, generator=g) < 0.25, ignore_index)
    t.view(-1)[1] = ignore_index  # at least one ignored row in every case
    return t


def _ce_cases(world):
    """(key, logits [..., V], target, upstream grad, ignore_index, reduction, label_smoothing)"""
    g = torch.Generator().manual_seed(100 + world)
    cases = []
    for shape in ((3, 7), (5,)):
        for dtype in DTYPES:
            for reduction in REDUCTIONS:
                for eps in (0.0, 0.1):
                    logits = (3 * torch.randn(*shape, V, generator=g)).to(dtype)
                    key = (shape, dtype, reduction, eps, IGNORE)
                    cases.append((key, logits, _targets(shape, g), torch.randn(shape, generator=g),
                                  IGNORE, reduction, eps))
    # a pad token inside the vocabulary as ignore_index (owned by rank 0)
    logits = 3 * torch.randn(4, 5, V, generator=g)
    cases.append((((4, 5), torch.float32, "mean", 0.0, 0), logits, _targets((4, 5), g, 0),
                  torch.randn(4, 5, generator=g), 0, "mean", 0.0))
    return cases


def _model_cases(world):
    """Embedding -> (tied or untied) lm head -> loss, fp32: (key, emb, head, ids, target, gy)."""
    g = torch.Generator().manual_seed(200 + world)
    cases = []
    for reduction in REDUCTIONS:
        for tied in (False, True):
            emb, head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g) / D ** 0.5
            ids = torch.randint(0, V, (3, 7), generator=g)
            cases.append(((reduction, tied), emb, head, ids, _targets((3, 7), g),
                          torch.randn(3, 7, generator=g)))
    return cases


PADDINGS = (None, V // 2 + 5, -1)  # none; inside the shard of rank tp/2; the last row


def _padding_inputs(world):
    g = torch.Generator().manual_seed(300 + world)
    ids = torch.randint(0, V, (3, 7), generator=g)
    ids[0, :3] = V // 2 + 5
    ids[2, -2:] = V - 1
    return ids, torch.randn(3, 7, D, generator=g)


def _err(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks the type by name
        return type(e).__name__, str(e)
    return None


def _worker(rank, world):
    import torch.distributed as dist

    from pyfast.parallel.tp_comm import copy_to_tp_region
    from pyfast.parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

    shard = slice(rank * V // world, (rank + 1) * V // world)
    out = {}

    def loss_and_backward(logits, target, gy, **kw):
        loss = vocab_parallel_cross_entropy(logits, target, **kw)
        loss.backward(gy if kw["reduction"] == "none" else None)
        return loss.detach()

    for key, logits, target, gy, ignore_index, reduction, eps in _ce_cases(world):
        x = logits[..., shard].clone().requires_grad_(True)
        loss = loss_and_backward(x, target, gy, ignore_index=ignore_index, reduction=reduction,
                                 label_smoothing=eps)
        out["ce", key] = loss, x.grad
        assert torch.equal(x.detach(), logits[..., shard]), f"{key}: logits modified in place"
        with torch.no_grad():  # evaluation: the same loss, no graph
            assert torch.equal(vocab_parallel_cross_entropy(
                x, target, ignore_index=ignore_index, reduction=reduction,
                label_smoothing=eps), loss), f"{key}: no_grad loss differs"

    for key, emb_w, head_w, ids, target, gy in _model_cases(world):
        reduction, tied = key
        dense = nn.Embedding(V, D)
        with torch.no_grad():
            dense.weight.copy_(emb_w)
        emb = VocabParallelEmbedding.from_embedding(dense)
        head = emb.weight if tied else head_w[shard].clone().requires_grad_(True)
        h = emb(ids)
        logits = F.linear(copy_to_tp_region(h), head)  # a ColumnParallelLinear lm head
        logits.retain_grad()
        loss = loss_and_backward(logits, target, gy, reduction=reduction)
        out["model", key] = (loss, h.detach(), emb.weight.grad,
                             None if tied else head.grad, logits.grad)

    ids, gy = _padding_inputs(world)
    for p in PADDINGS:
        torch.manual_seed(400)
        emb = VocabParallelEmbedding(V, D, padding_idx=p)
        w0 = emb.weight.detach().clone()
        y = emb(ids)
        y.backward(gy)
        out["pad", p] = w0, y.detach(), emb.weight.grad, emb.weight.tensor_parallel, \
            emb.weight.partition_dim

    emb = VocabParallelEmbedding(V, D)
    x = torch.randn(2, V // world, requires_grad=True)
    loss = vocab_parallel_cross_entropy(x, torch.tensor([1, 2]), reduction="sum")
    loss.backward(retain_graph=True)
    out["err"] = {
        "not divisible": _err(lambda: VocabParallelEmbedding(V + 1, D)),
        "padding range": _err(lambda: VocabParallelEmbedding(V, D, padding_idx=V)),
        "id too big": _err(lambda: emb(torch.tensor([[0, 5], [V, 1]]))),
        "id negative": _err(lambda: emb(torch.tensor([-1, 0]))),
        "float ids": _err(lambda: emb(torch.tensor([0.0, 1.0]))),
        "not embedding": _err(lambda: VocabParallelEmbedding.from_embedding(nn.Linear(2, 2))),
        "max_norm": _err(lambda: VocabParallelEmbedding.from_embedding(
            nn.Embedding(V, D, max_norm=1.0))),
        "target too big": _err(lambda: vocab_parallel_cross_entropy(
            x, torch.tensor([V, IGNORE]))),
        "target negative": _err(lambda: vocab_parallel_cross_entropy(x, torch.tensor([0, -1]))),
        "float target": _err(lambda: vocab_parallel_cross_entropy(x, torch.tensor([0.0, 1.0]))),
        "int logits": _err(lambda: vocab_parallel_cross_entropy(
            torch.ones(2, 3, dtype=torch.long), torch.tensor([0, 1]))),
        "target shape": _err(lambda: vocab_parallel_cross_entropy(x, torch.tensor([0, 1, 2]))),
        "reduction": _err(lambda: vocab_parallel_cross_entropy(x, torch.tensor([0, 1]),
                                                                reduction="avg")),
        "smoothing": _err(lambda: vocab_parallel_cross_entropy(x, torch.tensor([0, 1]),
                                                                label_smoothing=1.5)),
        "second backward": _err(lambda: loss.backward()),
    }
    # every rank raised the same errors and none is left inside a collective
    t = torch.ones(1)
    dist.all_reduce(t)
    out["alive"] = t.item()
    return out


def _dense_ce(logits, target, gy, ignore_index, reduction, eps):
    x = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(x.float().reshape(-1, V), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=eps)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    loss.backward(gy if reduction == "none" else None)
    return loss.detach(), x.grad


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    world = request.param
    return world, run_ranks(_worker, world)


def test_cross_entropy_matches_dense(ranks):
    world, res = ranks
    for key, logits, target, gy, ignore_index, reduction, eps in _ce_cases(world):
        ref_loss, ref_grad = _dense_ce(logits, target, gy, ignore_index, reduction, eps)
        dtype = key[1]
        for r, o in enumerate(res):
            loss, grad = o["ce", key]
            assert loss.dtype == torch.float32 and grad.dtype == dtype, key
            torch.testing.assert_close(loss, ref_loss, **FP32, msg=lambda m: f"{key}: {m}")
            torch.testing.assert_close(grad, ref_grad.chunk(world, -1)[r], **ULP[dtype],
                                       msg=lambda m: f"{key} rank {r}: {m}")
            assert torch.equal(loss, res[0]["ce", key][0]), f"{key}: ranks disagree"
        # ignored rows: zero loss and zero gradient
        ignored = target == ignore_index
        assert ignored.any()
        if reduction == "none":
            assert (res[0]["ce", key][0][ignored] == 0).all()
        for r, o in enumerate(res):
            assert (o["ce", key][1][ignored] == 0).all()


def test_embedding_and_loss_match_dense_model(ranks):
    world, res = ranks
    for key, emb_w, head_w, ids, target, gy in _model_cases(world):
        reduction, tied = key
        emb = nn.Embedding(V, D)
        with torch.no_grad():
            emb.weight.copy_(emb_w)
        head = emb.weight if tied else head_w.clone().requires_grad_(True)
        h = emb(ids)
        logits = F.linear(h, head)
        logits.retain_grad()
        loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction=reduction)
        if reduction == "none":
            loss = loss.reshape(target.shape)
        loss.backward(gy if reduction == "none" else None)
        for r, o in enumerate(res):
            p_loss, p_h, p_emb_grad, p_head_grad, p_logits_grad = o["model", key]
            msg = lambda m: f"{key} rank {r}: {m}"  # noqa: E731
            assert torch.equal(p_h, h.detach()), msg("embedding output differs")
            torch.testing.assert_close(p_loss, loss.detach(), **FP32, msg=msg)
            torch.testing.assert_close(p_logits_grad, logits.grad.chunk(world, -1)[r], **FP32,
                                       msg=msg)
            torch.testing.assert_close(p_emb_grad, emb.weight.grad.chunk(world, 0)[r], **FP32,
                                       msg=msg)
            if not tied:
                torch.testing.assert_close(p_head_grad, head.grad.chunk(world, 0)[r], **FP32,
                                           msg=msg)
            assert torch.equal(p_loss, res[0]["model", key][0]), f"{key}: ranks disagree"


def test_default_init_and_padding_idx(ranks):
    world, res = ranks
    ids, gy = _padding_inputs(world)
    for p in PADDINGS:
        torch.manual_seed(400)
        emb = nn.Embedding(V, D, padding_idx=p)  # the table the same seed gives, unsharded
        y = emb(ids)
        y.backward(gy)
        for r, o in enumerate(res):
            w0, p_y, p_grad, tp, dim = o["pad", p]
            assert tp is True and dim == 0
            assert torch.equal(w0, emb.weight.detach().chunk(world, 0)[r]), (p, r)
            assert torch.equal(p_y, y.detach()), (p, r)
            torch.testing.assert_close(p_grad, emb.weight.grad.chunk(world, 0)[r], **FP32)
        if p is not None:
            row = p % V
            owner, local = divmod(row, V // world)
            assert (res[owner]["pad", p][0][local] == 0).all()  # padding row starts at zero
            assert (res[owner]["pad", p][2][local] == 0).all()  # and gets no gradient
            assert (ids == row).any()


def test_bad_inputs_fail_with_clear_messages(ranks):
    world, res = ranks
    for o in res:
        e = o["err"]
        assert e == res[0]["err"]  # every rank took the same decision
        assert e["not divisible"][0] == "ValueError"
        msg = e["not divisible"][1]
        assert "VocabParallelEmbedding" in msg and f"({V + 1}, {D})" in msg
        assert f"tensor-parallel size {world}" in msg
        assert e["padding range"][0] == "ValueError" and "padding_idx" in e["padding range"][1]
        assert e["id too big"] == ("IndexError", f"VocabParallelEmbedding(num_embeddings={V}, "
                                   f"embedding_dim={D}): id {V} is out of range [0, {V})")
        assert e["id negative"][0] == "IndexError" and "id -1 is out" in e["id negative"][1]
        assert e["float ids"][0] == "TypeError" and "torch.float32" in e["float ids"][1]
        assert e["not embedding"][0] == "TypeError" and "Linear" in e["not embedding"][1]
        assert e["max_norm"][0] == "NotImplementedError" and "max_norm" in e["max_norm"][1]
        assert e["target too big"][0] == "IndexError"
        assert f"target (ignore_index={IGNORE}) {V} is out of range [0, {V})" in \
            e["target too big"][1]
        assert e["target negative"][0] == "IndexError" and " -1 is out" in e["target negative"][1]
        assert e["float target"][0] == "TypeError" and "target" in e["float target"][1]
        assert e["int logits"][0] == "TypeError" and "floating-point" in e["int logits"][1]
        assert e["target shape"][0] == "ValueError" and "(3,)" in e["target shape"][1]
        assert e["reduction"][0] == "ValueError" and "'avg'" in e["reduction"][1]
        assert e["smoothing"][0] == "ValueError" and "label_smoothing" in e["smoothing"][1]
        assert e["second backward"][0] == "RuntimeError"
        assert "modified by an inplace operation" in e["second backward"][1]
        assert o["alive"] == world
