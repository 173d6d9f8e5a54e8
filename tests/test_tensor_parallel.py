"""ColumnParallelLinear / RowParallelLinear at 2 and 4 gloo ranks against a dense nn.Linear.

Every rank builds the same dense layer and data from fixed seeds, shards the layer with
from_linear and runs one case after another in a single spawn per world size; the parent
runs the dense layer and compares each rank's output and every gradient (input, weight shard,
bias) with the matching slice of the dense one.

Tolerances. fp32: rtol 1e-5, atol 1e-5. A row layer's output is tp partial dot products (in/tp
terms each) summed by the all-reduce, in another order than the dense GEMM's one accumulation,
so it differs by a few ulps of the partials; atol covers values near zero by cancellation,
whose error is relative to the terms, not to the value: a weight gradient is 24 products of
unit normals (sum of |terms| ~15), reordered error ~sqrt(24) x 6e-8 x 15 = 4e-6 (measured
1.7e-6 on a 0.07 value with ATEN_CPU_CAPABILITY=default, which failed the former atol 1e-6).
bf16: rtol 1.6e-2 (torch's bf16 default, 2^-6) and atol 2e-2: each rank's partial is rounded
to bf16 (8 significant bits) before the sum, and so is the sum.
"""
import pytest
import torch
from torch import nn

from dist_utils import run_ranks, value_error_text

COL = (37, 24)  # dense (in, out) of the column cases: out split; in odd
ROW = (24, 37)  # of the row cases: in split; out odd
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}

# name: (layer, kwargs, leading dims of x, dtype, bias)
CASES = {
    "col": ("col", {}, (8, 3), torch.float32, True),
    "col_nobias": ("col", {}, (8, 3), torch.float32, False),
    "col_gather": ("col", {"gather_output": True}, (5, 3), torch.float32, True),
    "row": ("row", {}, (8, 3), torch.float32, True),
    "row_nobias": ("row", {}, (8, 3), torch.float32, False),
    "row_scatter": ("row", {"input_is_parallel": False}, (5, 3), torch.float32, True),
    "col_sp0": ("col", {"sequence_parallel": True}, (8, 3), torch.float32, True),
    "col_sp1": ("col", {"sequence_parallel": True, "sequence_dim": 1}, (3, 8), torch.float32,
                True),
    "row_sp0": ("row", {"sequence_parallel": True}, (8, 3), torch.float32, True),
    "row_sp1": ("row", {"sequence_parallel": True, "sequence_dim": 1}, (3, 8), torch.float32,
                True),
    "col_bf16": ("col", {}, (8, 3), torch.bfloat16, True),
    "row_bf16": ("row", {}, (8, 3), torch.bfloat16, True),
    "row_sp0_bf16": ("row", {"sequence_parallel": True}, (8, 3), torch.bfloat16, True),
    # overlap: async_tp's pieces need >= 4 rows each, so longer sequences
    "col_sp0_overlap": ("col", {"sequence_parallel": True, "overlap": 4}, (16, 3),
                        torch.float32, True),
    "row_sp1_overlap3": ("row", {"sequence_parallel": True, "sequence_dim": 1, "overlap": 3},
                         (3, 24), torch.float32, True),
    "row_sp0_overlap_bf16": ("row", {"sequence_parallel": True, "overlap": 2}, (16, 3),
                             torch.bfloat16, True),
}
OVERLAP_PAIRS = [("col", 0, torch.float32), ("row", 0, torch.float32), ("col", 1, torch.bfloat16),
                 ("row", 1, torch.bfloat16)]


def _layout(layer, kw):
    """How this rank's tensors slice the dense ones: dims of x, y, weight, bias (None: whole)."""
    sp = kw.get("sequence_dim", 0) if kw.get("sequence_parallel") else None
    if layer == "col":
        return dict(x=sp, y=None if kw.get("gather_output") else -1, w=0, b=0)
    return dict(x=-1 if kw.get("input_is_parallel", True) else None, y=sp, w=1, b=None)


def _dense(name):
    layer, kw, lead, dtype, bias = CASES[name]
    fin, fout = COL if layer == "col" else ROW
    torch.manual_seed(len(name))
    dense = nn.Linear(fin, fout, bias=bias).to(dtype)
    g = torch.Generator().manual_seed(100 + len(name))
    x = torch.randn(*lead, fin, generator=g).to(dtype)
    gy = torch.randn(*lead, fout, generator=g).to(dtype)
    return dense, x, gy


def _local(t, dim, rank, world):
    return t if dim is None else t.chunk(world, dim)[rank]


def _worker(rank, world):
    from pyfast.parallel import ColumnParallelLinear, RowParallelLinear
    out = {}
    for name, (layer, kw, _, _, _) in CASES.items():
        dense, x, gy = _dense(name)
        cls = ColumnParallelLinear if layer == "col" else RowParallelLinear
        m = cls.from_linear(dense, **kw)
        lay = _layout(layer, kw)
        x = _local(x, lay["x"], rank, world).clone().requires_grad_(True)
        y = m(x)
        y.backward(_local(gy, lay["y"], rank, world))
        out[name] = dict(y=y.detach(), x=x.grad, w=m.weight.grad,
                         b=None if m.bias is None else m.bias.grad,
                         dtype=m.weight.dtype, attrs=(m.weight.tensor_parallel,
                                                      m.weight.partition_dim))

    for layer, dim, dtype in OVERLAP_PAIRS:  # the same inputs with and without overlap
        cls = ColumnParallelLinear if layer == "col" else RowParallelLinear
        torch.manual_seed(5)
        dense = nn.Linear(*(COL if layer == "col" else ROW)).to(dtype)
        shape = [3, 3]
        shape[dim] = 8 * world
        x = torch.randn(*shape, dense.in_features).to(dtype)
        x = _local(x, dim if layer == "col" else -1, rank, world)
        gy = torch.randn(*shape, dense.out_features).to(dtype)
        gy = _local(gy, -1 if layer == "col" else dim, rank, world)
        for ov in (0, 2):
            m = cls.from_linear(dense, sequence_parallel=True, sequence_dim=dim, overlap=ov)
            xi = x.clone().requires_grad_(True)
            y = m(xi)
            y.backward(gy)
            out["pair", layer, dim, ov] = (y.detach(), xi.grad, m.weight.grad, m.bias.grad)

    auto = ColumnParallelLinear(*COL, sequence_parallel=True, overlap=True)
    out["pieces"] = (auto._pieces(1000), auto._pieces(1 << 20), auto.pieces)

    torch.manual_seed(11)
    c = ColumnParallelLinear(*COL)
    torch.manual_seed(11)
    r = RowParallelLinear(256, 5)
    out["init"] = dict(c=(c.weight.detach(), c.bias.detach()),
                       r=(r.weight.detach(), r.bias.detach()))
    out["attrs"] = dict(c=[(p.tensor_parallel, p.partition_dim) for p in (c.weight, c.bias)],
                        r=[(p.tensor_parallel, p.partition_dim) for p in (r.weight, r.bias)],
                        repr=(repr(c), repr(r)))

    odd = 2 * world + 1
    row = RowParallelLinear(*ROW)
    out["errors"] = {
        "col_features": (value_error_text(lambda: ColumnParallelLinear(8, odd)),
                         ["ColumnParallelLinear(in_features=8, out_features=%d)" % odd,
                          f"({odd}, 8)"]),
        "row_features": (value_error_text(lambda: RowParallelLinear(odd, 8)),
                         ["RowParallelLinear(in_features=%d, out_features=8)" % odd,
                          f"(8, {odd})"]),
        "col_input": (value_error_text(lambda: c(torch.randn(2, 3, COL[0] + 1))),
                      ["ColumnParallelLinear(in_features=37, out_features=24)",
                       f"(2, 3, {COL[0] + 1})"]),
        "row_input_parallel": (value_error_text(lambda: row(torch.randn(2, 3, ROW[0]))),
                               ["RowParallelLinear(in_features=24, out_features=37)",
                                f"(2, 3, {ROW[0]})", f"expected {ROW[0] // world}"]),
        "row_input_whole": (
            value_error_text(lambda: RowParallelLinear(*ROW, input_is_parallel=False)(
                torch.randn(2, 3, ROW[0] // world))),
            ["RowParallelLinear(in_features=24, out_features=37)", f"(2, 3, {ROW[0] // world})"]),
        "row_sp_sequence": (
            value_error_text(lambda: RowParallelLinear(*ROW, sequence_parallel=True)(
                torch.randn(odd, 3, ROW[0] // world))),
            ["RowParallelLinear(in_features=24, out_features=37)",
             f"({odd}, 3, {ROW[0] // world})"]),
        "overlap_without_sp": (value_error_text(lambda: ColumnParallelLinear(*COL, overlap=True)),
                               ["ColumnParallelLinear", "sequence_parallel=True"]),
        "row_sp_not_parallel": (
            value_error_text(lambda: RowParallelLinear(*ROW, sequence_parallel=True,
                                             input_is_parallel=False)),
            ["RowParallelLinear(in_features=24, out_features=37)", "input_is_parallel"]),
    }
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, run_ranks(_worker, request.param)


def test_overlap_true_skips_small_calls(ranks):
    """overlap=True: calls moving under OVERLAP_MIN_BYTES take the plain path (0 pieces)."""
    from pyfast.parallel.tensor import OVERLAP_CHUNKS
    for o in ranks[1]:
        assert o["pieces"] == (0, OVERLAP_CHUNKS, OVERLAP_CHUNKS)


@pytest.mark.parametrize("layer,dim,dtype", OVERLAP_PAIRS)
def test_overlap_equals_plain_sequence_parallel(ranks, layer, dim, dtype):
    """async_tp's pieces run the same GEMM on the same rows: at 2 ranks every sum is a + b
    either way, so bitwise; at 4 ranks its partial sums go in rank order and gloo's
    reduce-scatter in ring order, each of the 3 additions rounded: fp32 within rtol 1e-6; bf16
    (sums rounded to 8 bits each time) within 3 ulps of the largest value, 3 * 2^-8 * max|a|."""
    world, res = ranks
    for o in res:
        for a, b in zip(o["pair", layer, dim, 0], o["pair", layer, dim, 2]):
            if world == 2:
                assert torch.equal(a, b)
            elif dtype == torch.float32:
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
            else:
                torch.testing.assert_close(b, a, rtol=2 ** -7,
                                           atol=3 * 2 ** -8 * a.abs().max().item())


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_dense(ranks, name):
    world, res = ranks
    layer, kw, _, dtype, bias = CASES[name]
    dense, x, gy = _dense(name)
    x.requires_grad_(True)
    y = dense(x)
    y.backward(gy)
    lay, tol = _layout(layer, kw), TOL[dtype]
    for r, o in enumerate(res):
        got = o[name]
        assert got["dtype"] == dtype and got["attrs"] == (True, lay["w"])
        torch.testing.assert_close(got["y"], _local(y.detach(), lay["y"], r, world), **tol)
        torch.testing.assert_close(got["x"], _local(x.grad, lay["x"], r, world), **tol)
        torch.testing.assert_close(got["w"], _local(dense.weight.grad, lay["w"], r, world), **tol)
        if bias:
            torch.testing.assert_close(got["b"], _local(dense.bias.grad, lay["b"], r, world),
                                       **tol)
        else:
            assert got["b"] is None
        if lay["y"] is None:  # replicated outputs: every rank holds the same bits
            assert torch.equal(got["y"], res[0][name]["y"])


def test_default_init_is_nn_linear_sliced(ranks):
    world, res = ranks
    torch.manual_seed(11)
    c = nn.Linear(*COL)
    torch.manual_seed(11)
    r = nn.Linear(256, 5)
    for rank, o in enumerate(res):
        (cw, cb), (rw, rb) = o["init"]["c"], o["init"]["r"]
        # the same seed gives the dense layer's slice exactly, whatever the TP size
        assert torch.equal(cw, c.weight.detach().chunk(world, 0)[rank])
        assert torch.equal(cb, c.bias.detach().chunk(world, 0)[rank])
        assert torch.equal(rw, r.weight.detach().chunk(world, 1)[rank])
        assert torch.equal(rb, r.bias.detach())
        # kaiming_uniform(a=sqrt(5)) of the FULL fan_in: bound 1/sqrt(256) = 1/16, not the
        # shard's 1/sqrt(256/tp); 5 x 256/tp uniform draws come within 10% of it
        assert rw.shape == (5, 256 // world)
        bound = 1 / 16
        assert rw.abs().max() <= bound and rw.abs().max() > 0.9 * bound
        assert rb.abs().max() <= bound


def test_attributes_and_repr(ranks):
    world, res = ranks
    for o in res:
        a = o["attrs"]
        assert a["c"] == [(True, 0), (True, 0)]
        assert a["r"] == [(True, 1), (False, None)]
        assert f"in_features=37, out_features=24, tp={world}" in a["repr"][0]
        assert f"in_features=256, out_features=5, tp={world}" in a["repr"][1]


def test_bad_input_messages(ranks):
    world, res = ranks
    for o in res:
        for what, (msg, parts) in o["errors"].items():
            for part in parts + [f"tensor-parallel size {world}"]:
                assert part in msg, f"{what}: {part!r} not in {msg!r}"


# ----------------------------------------------------------------- autocast, on every backend
# Under torch.autocast("cpu", bf16) the layers compute what the dense nn.Linear computes there:
# x, weight and bias cast to bf16, the GEMM (torch's, or Triton's in its interpreter when
# PYFAST_BACKEND=triton) and the bias add in bf16. Same output dtype (bf16) as the dense layer;
# values and gradients within TOL[bf16] (a row layer's partials are rounded to bf16 before the
# all-reduce; the dense GEMM rounds once).
AMP_CASES = {  # name: (layer, kwargs, leading dims of x)
    "col": ("col", {}, (8, 3)),
    "col_gather": ("col", {"gather_output": True}, (4, 3)),
    "row": ("row", {}, (8, 3)),
    "row_scatter": ("row", {"input_is_parallel": False}, (4, 3)),
    "col_sp": ("col", {"sequence_parallel": True}, (8, 3)),
    "row_sp": ("row", {"sequence_parallel": True}, (8, 3)),
    "col_sp_async": ("col", {"sequence_parallel": True, "overlap": 2}, (16, 3)),
    "row_sp_async": ("row", {"sequence_parallel": True, "overlap": 2}, (16, 3)),
}


def _amp_run(m, x, gy):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    y.backward(gy.to(y.dtype))
    return dict(y=y.detach(), x=x.grad, w=m.weight.grad, b=m.bias.grad)


def _amp_worker(rank, world):
    import os

    from pyfast.ops import status
    from pyfast.parallel import ColumnParallelLinear, RowParallelLinear
    out = {}
    for backend in ("torch", "cpp", "triton"):
        if not status(backend, torch.device("cpu"))[0]:
            continue
        os.environ["PYFAST_BACKEND"] = backend
        for name, (layer, kw, lead) in AMP_CASES.items():
            fin, fout = COL if layer == "col" else ROW
            torch.manual_seed(len(name))
            dense = nn.Linear(fin, fout)
            x, gy = torch.randn(*lead, fin), torch.randn(*lead, fout)
            cls = ColumnParallelLinear if layer == "col" else RowParallelLinear
            m = cls.from_linear(dense, **kw)
            lay = _layout(layer, kw)
            got = _amp_run(m, _local(x, lay["x"], rank, world), _local(gy, lay["y"], rank, world))
            want = _amp_run(dense, x, gy)
            want = dict(y=_local(want["y"], lay["y"], rank, world),
                        x=_local(want["x"], lay["x"], rank, world),
                        w=_local(want["w"], lay["w"], rank, world),
                        b=_local(want["b"], lay["b"], rank, world))
            out[backend, name] = got, want
        del os.environ["PYFAST_BACKEND"]
    return out


def _two_rank_worker(rank, world):  # one spawn for the autocast and the device cases
    return _amp_worker(rank, world), _meta_worker(rank, world)


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_worker, 2)


@pytest.fixture(scope="module")
def amp_ranks(two_ranks):
    return [amp for amp, _ in two_ranks]


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_layers_under_autocast_match_dense(amp_ranks, backend):
    from pyfast.ops import status
    ok, why = status(backend, torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    for rank, o in enumerate(amp_ranks):
        for name in AMP_CASES:
            got, want = o[backend, name]
            for k in ("y", "x", "w", "b"):
                assert got[k].dtype == want[k].dtype, (rank, name, k, got[k].dtype, want[k].dtype)
                torch.testing.assert_close(got[k], want[k], **TOL[torch.bfloat16],
                                           msg=lambda m: f"{backend} {name} {k} rank {rank}: {m}")


# ----------------------------------------------------------------- buffers follow the device
def _meta_worker(rank, world):
    """Every layer twice, the second time with torch's default device set to meta while the
    modules and inputs are explicitly on the CPU: a buffer that does not follow its tensors'
    device becomes a meta tensor and fails (gloo cannot send it; meta and cpu do not mix)."""
    from pyfast.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from pyfast.parallel import vocab_parallel_cross_entropy
    from pyfast.parallel.async_tp import all_gather_linear, linear_reduce_scatter
    cpu = torch.device("cpu")

    def cases():
        torch.manual_seed(3)
        col = ColumnParallelLinear(*COL, device=cpu)
        row = RowParallelLinear(*ROW, device=cpu)
        emb = VocabParallelEmbedding(4 * world, 5, device=cpu)
        col_async = ColumnParallelLinear(*COL, sequence_parallel=True, overlap=2, device=cpu)
        row_async = RowParallelLinear(*ROW, sequence_parallel=True, overlap=2, device=cpu)
        w = torch.randn(6, 5, device=cpu, requires_grad=True)
        x = torch.randn(8, 3, COL[0], device=cpu)
        h = torch.randn(8, 3, ROW[0] // world, device=cpu)
        ids = torch.randint(0, 4 * world, (3, 4), device=cpu)
        return {
            "col": lambda: col(x),
            "row": lambda: row(h),
            "vocab": lambda: emb(ids),
            "vocab_ce": lambda: vocab_parallel_cross_entropy(emb(ids) @ w.t(), ids),
            "col_async": lambda: col_async(x),
            "row_async": lambda: row_async(h),
            "agl": lambda: all_gather_linear(torch.randn(4, 5, device=cpu), w, pieces=2),
            "lrs": lambda: linear_reduce_scatter(torch.randn(4 * world, 5, device=cpu), w,
                                                 pieces=2),
        }

    def run(meta: bool):
        res = {}
        for name, fn in cases().items():
            torch.set_default_device("meta" if meta else None)
            try:
                y = fn()
                y.float().square().sum().backward()
                res[name] = (y.device.type, y.detach())
            except Exception as e:  # noqa: BLE001  (reported to the parent for the assertion)
                res[name] = (f"{type(e).__name__}: {e}", None)
            finally:
                torch.set_default_device(None)
        return res
    return run(False), run(True)


def test_layers_follow_their_tensors_device_not_the_default(two_ranks):
    for rank, (_, (plain, meta)) in enumerate(two_ranks):
        for name, (dev, y) in plain.items():
            assert dev == "cpu", (rank, name, dev)
            assert meta[name][0] == "cpu", (rank, name, meta[name][0])
            assert torch.equal(meta[name][1], y), (rank, name)
