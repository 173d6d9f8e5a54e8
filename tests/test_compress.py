"""Compressors: round trips, stated error bounds, honest wire sizes, state, bad input."""
import math

import pytest
import torch

import pyfast.compress as C

SPECS = ["none", "fp16", "bf16", "fp8", "int8", "int4", "sign", "topk:0.01", "randomk:0.05",
         "powersgd:4"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def grad(*shape, dtype=torch.float32):
    return (torch.randn(*shape) * torch.exp(torch.randn(*shape).clamp(-2, 2))).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_shape_dtype(spec, dtype):
    c = C.get(spec)
    for x in (grad(33, 65, dtype=dtype), grad(1025, dtype=dtype), grad(8, 40, dtype=dtype).t(),
              torch.empty(0, dtype=dtype), torch.zeros(3, 700, dtype=dtype)):
        p = c.compress(x, "w")
        y = c.decompress(p)
        assert y.shape == x.shape and y.dtype == x.dtype
        if x.numel() and not x.any():
            assert torch.equal(y, torch.zeros_like(x)), "zeros must stay zeros (no 0/0)"
        if not x.numel():
            assert p.nbytes <= 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_values_do_not_depend_on_layout_or_width(spec, dtype):
    """A non-contiguous input gives bitwise what its contiguous copy gives; a 16-bit input gives
    what its float32 widening gives, rounded once to the 16-bit type: within half an ulp of
    that type (|y16 - y32| <= eps/2 |y32|). Fresh compressors on each side (same state)."""
    def round_trip(x):
        c = C.get(spec)
        return c.decompress(c.compress(x, "w"))
    x = grad(8, 40, dtype=dtype).t()
    assert torch.equal(round_trip(x), round_trip(x.contiguous())), "non-contiguous input differs"
    x = grad(33, 65, dtype=dtype)
    y, wide = round_trip(x).float(), round_trip(x.float())
    bound = torch.finfo(dtype).eps / 2 * wide.abs()
    assert ((y - wide).abs() <= bound).all(), (
        f"{spec} {dtype}: {int(((y - wide).abs() > bound).sum())} of {y.numel()} values beyond "
        f"half an ulp of the float32 result; worst {float((y - wide).abs().max())}")


def rel_err(x, y):
    return float((y.float() - x.float()).norm() / x.float().norm())


def test_error_bounds():
    x = grad(4000)
    blocks = x.view(-1)[: 4000 // 512 * 512].view(-1, 512)
    amax = blocks.abs().amax(1).repeat_interleave(512)
    for spec, half_step in (("int8", 127), ("int4", 7)):
        y = C.get(spec).decompress(C.get(spec).compress(x))
        # round to nearest: at most half a step (amax / qmax / 2), plus fp32 rounding of y
        err = (y - x)[: amax.numel()].abs()
        assert (err <= amax / half_step / 2 * (1 + 1e-6)).all(), spec
    y = C.get("fp8").decompress(C.get("fp8").compress(x))
    # e4m3: 3 mantissa bits -> relative half-step 2^-4 for normals; subnormal step 2^-9 * scale
    scale = amax / 448
    assert ((y - x)[: amax.numel()].abs() <= x[: amax.numel()].abs() / 16 + scale * 2 ** -10
            + 1e-12).all()
    assert rel_err(x, C.get("fp16").decompress(C.get("fp16").compress(x))) < 2 ** -11
    assert rel_err(x, C.get("bf16").decompress(C.get("bf16").compress(x))) < 2 ** -8
    y = C.get("sign").decompress(C.get("sign").compress(x))
    assert torch.equal(y.sign(), x.sign())
    torch.testing.assert_close(y[:512].abs(), x[:512].abs().mean().expand(512))
    assert torch.equal(C.get("none").decompress(C.get("none").compress(x)), x)


def test_wire_bytes_are_counted():
    n = 10_001
    x = grad(n)
    nb = math.ceil(n / 512)
    assert C.get("int8").compress(x).nbytes == n + 4 * nb
    assert C.get("fp8").compress(x).nbytes == n + 4 * nb
    assert C.get("int4").compress(x).nbytes == (n + 1) // 2 + 4 * nb
    assert C.get("sign").compress(x).nbytes == (n + 7) // 8 + 4 * nb
    assert C.get("fp16").compress(x).nbytes == 2 * n
    p = C.get("topk:0.01").compress(x)
    m = p.tensors["values"].numel()
    assert p.nbytes == 4 + m * (4 + 4)  # count + fp32 values + int32 indices
    p = C.get("randomk:0.01").compress(x.bfloat16())
    assert p.nbytes == 2 * p.tensors["values"].numel()  # values only: indices come from a seed
    m2 = grad(200, 300)
    assert C.get("powersgd:4").compress(m2).nbytes == 4 * 4 * (200 + 300)


def test_topk_keeps_exact_largest():
    x = grad(50_000)
    y = C.get("topk:0.01").decompress(C.get("topk:0.01").compress(x))
    kept = y != 0
    assert 250 <= kept.sum() <= 750
    assert torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_randomk_shared_seed():
    a, b = C.get("randomk:0.01", seed=7), C.get("randomk:0.01", seed=7)
    x1, x2 = grad(30_000), grad(30_000)  # two ranks' different gradients
    p1, p2 = a.compress(x1, "w"), b.compress(x2, "w")
    i1, i2 = (a.decompress(p1) != 0), (b.decompress(p2) != 0)
    assert torch.equal(i1, i2), "ranks must agree on the indices without sending them"
    assert 150 <= i1.sum() <= 450
    q1 = a.compress(x1, "w")  # next step: new indices
    assert not torch.equal(a.decompress(q1) != 0, i1)
    assert torch.equal(a.decompress(q1)[a.decompress(q1) != 0], x1[a.decompress(q1) != 0])


def test_powersgd_recovers_low_rank_and_passes_vectors():
    u, v = torch.randn(120, 3), torch.randn(3, 90)
    m = u @ v  # rank 3 <= 4
    c = C.get("powersgd:4")
    torch.testing.assert_close(c.decompress(c.compress(m, "m")), m, rtol=1e-5, atol=1e-4)
    vec = grad(500)
    p = c.compress(vec, "b")
    assert "data" in p.tensors and torch.equal(c.decompress(p), vec)
    conv = grad(16, 8, 3, 3)  # conv weight: viewed as 16 x 72
    assert c.decompress(c.compress(conv, "c")).shape == conv.shape


def test_powersgd_warm_start_state_round_trip():
    m = grad(64, 80)
    a = C.get("powersgd:2")
    a.compress(m, "w")
    b = C.get("powersgd:2")
    b.load_state_dict(a.state_dict())
    pa, pb = a.compress(m, "w"), b.compress(m, "w")
    assert torch.equal(pa.tensors["p"], pb.tensors["p"])
    fresh = C.get("powersgd:2", warm_start=False)
    assert fresh.compress(m, "w") and fresh.state_dict() == {"q": {}}


@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_loses_nothing(spec):
    ef = C.ErrorFeedback(C.get(spec))
    xs = [grad(40, 50) for _ in range(5)]
    sent = torch.zeros(40, 50)
    for x in xs:
        sent += ef.decompress(ef.compress(x, "w")).float()
    residual = ef.memory["w"].view(40, 50) if "w" in ef.memory else torch.zeros(40, 50)
    # sum of what was sent + what is remembered == sum of the gradients (fp32 rounding only)
    torch.testing.assert_close(sent + residual, sum(xs), rtol=1e-5, atol=1e-5)


def test_error_feedback_state_dict():
    ef = C.ErrorFeedback(C.get("int4"))
    x = grad(3000)
    ef.compress(x, "a")
    ef2 = C.ErrorFeedback(C.get("int4"))
    ef2.load_state_dict(ef.state_dict())
    x2 = grad(3000)
    assert torch.equal(ef.compress(x2, "a").tensors["codes"], ef2.compress(x2, "a").tensors["codes"])
    with pytest.raises(ValueError, match="3000 elements"):
        ef.compress(grad(10), "a")
    with pytest.raises(TypeError, match="float32"):
        ef2.load_state_dict({"memory": {"a": torch.zeros(3, dtype=torch.int32)}})
    with pytest.raises(ValueError, match="1-D float32"):
        ef2.load_state_dict({"memory": {"a": torch.zeros(3, 2)}})


@pytest.mark.parametrize("spec", SPECS)
def test_nonfinite_is_never_hidden(spec):
    c = C.get(spec)
    for bad in (float("nan"), float("inf")):
        x = grad(64, 64)
        x[5, 7] = bad
        try:
            y = c.decompress(c.compress(x, "w"))
        except ValueError as e:
            assert "NaN/Inf" in str(e)
            continue
        assert not torch.isfinite(y).all(), f"{spec} turned {bad} into finite numbers"


def test_get_rejects_bad_specs():
    for bad in ["int3", "topk", "topk:0", "topk:1.5", "topk:x", "randomk:-1", "powersgd:0",
                "powersgd:1.5", "none:1", ""]:
        with pytest.raises(ValueError, match="valid: none, fp16"):
            C.get(bad)
    with pytest.raises(TypeError):
        C.get(3)
    with pytest.raises(ValueError, match="options"):
        C.get("fp16", block=256)
    assert C.get("int8", block=256, stochastic=True).block == 256
    c = C.get("int8")
    assert C.get(c) is c and C.get(None).spec == "none"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "fp8", "int8", "int4", "sign",
                                  "topk:0.01", "randomk:0.05"])
def test_wire_round_trip(spec, dtype):
    # what a collective sends: one flat byte buffer of exactly p.nbytes, decoded elsewhere
    c = C.get(spec, seed=3) if spec.startswith("randomk") else C.get(spec)
    x = grad(3, 1001, dtype=dtype)  # odd sizes: alignment of every view in the buffer
    p = c.compress(x, "w")
    buf = c.to_wire(p).clone()
    assert buf.dtype == torch.uint8 and buf.numel() == p.nbytes
    q = c.from_wire(buf, x.shape, x.dtype, p.meta)
    assert torch.equal(c.decompress(q), c.decompress(p))
    if c.layout(x.numel()) is not None:
        with pytest.raises(ValueError, match="bytes"):
            c.from_wire(buf[:-1], x.shape, x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_decompress_into_out(spec, dtype):
    c = C.get(spec)
    x = grad(33, 65, dtype=dtype)  # ragged: a partial last block, an odd number of int4 codes
    p = c.compress(x, "w")
    ref = c.decompress(p)
    bucket = torch.full((3000,), float("nan"), dtype=dtype)  # out as a slice of a bucket
    outs = [torch.full_like(x, float("nan")), bucket[100:100 + x.numel()],
            torch.full((65, 33), float("nan"), dtype=dtype).t()]  # non-contiguous, x's shape
    for out in outs:
        assert c.decompress(p, out=out) is out
        assert torch.equal(out.reshape(-1), ref.reshape(-1)), f"out of shape {tuple(out.shape)}"
        assert torch.equal(out.reshape(-1).view(torch.int16 if dtype != torch.float32
                                                else torch.int32),
                           ref.reshape(-1).view(torch.int16 if dtype != torch.float32
                                                else torch.int32)), "bitwise (signs of zeros)"
    assert bucket[:100].isnan().all() and bucket[100 + x.numel():].isnan().all()
    other = torch.float16 if dtype != torch.float16 else torch.float32
    with pytest.raises(TypeError, match=f"{dtype}.*2145 elements"):
        c.decompress(p, out=torch.empty(2145, dtype=other))
    with pytest.raises(ValueError, match="2145 elements"):
        c.decompress(p, out=torch.empty(2146, dtype=dtype))
    with pytest.raises(ValueError, match="payload on cpu"):
        c.decompress(p, out=torch.empty(33, 65, dtype=dtype, device="meta"))


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("spec", SPECS)
def test_buffers_follow_the_input_device(spec, backend):
    # GPU-readiness on a CPU machine: every buffer allocated without device= lands on meta and
    # fails (meta mixed with cpu raises, .item() of meta raises); inputs are explicitly cpu
    from pyfast import perf
    from pyfast.ops import status
    ok, why = status(backend, torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    xs = [grad(33, 65), grad(1025, dtype=torch.bfloat16), torch.empty(0)]
    with perf.backend(backend), torch.device("meta"):
        for x in xs:
            for c in (C.get(spec), C.WithFeedback(C.get(spec))):
                p = c.compress(x, "w")
                y = c.decompress(p)
                assert y.device.type == "cpu" and y.shape == x.shape
                out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
                assert c.decompress(p, out=out) is out and torch.equal(out, y)
                buf = c.to_wire(p)
                assert buf.device.type == "cpu"
                if not spec.startswith("powersgd"):  # its collective sends P and Q itself
                    q = c.from_wire(buf, x.shape, x.dtype, p.meta)
                    assert torch.equal(c.decompress(q), y)
    ef, x = C.ErrorFeedback(C.get(spec)), grad(40, 50)
    with perf.backend(backend), torch.device("meta"):
        ef.compress(x, "a")
        assert ef.memory["a"].device.type == "cpu"
