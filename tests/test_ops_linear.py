"""linear_act's Triton path (kernels/matmul.py, in the interpreter) against linear_act_ref:
the output and every gradient (x, weight, bias), at small ragged shapes that span several
16-wide tiles on each of M, N and K.

Every result is a sum (y, dx, dW over K, N and M terms; db over M), and both sides round z and
dz to the dtype but sum in different orders, so z or dz may round to the neighbouring value and
a result moves by about one rounding of its terms. The bound is therefore relative to the sum
of the terms' magnitudes S (|x| |W|^T + |b|, |dy| |W|, |dy|^T |x|, sum |dy|; |gelu'| <= 1.13):
|got - ref| <= rtol (|ref| + S), rtol = 1e-4 fp32, 1e-2 bf16 (2^-8 a rounding), 1e-3 fp16
(2^-11). A plain atol fails where terms of size 1 cancel to a small dW: one fp16 rounding of
one dz moves it by 2^-9 (seen at M = 70).
"""
import pytest
import torch

from conftest import backend_params
from pyfast.ops import linear
from pyfast.ops import status

TRITON_OK, WHY = status("triton", torch.device("cpu"))
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=WHY)

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-3}  # rtol = atol
DTYPES = list(TOL)
ACTS = [None, "gelu", "gelu_tanh"]
SHAPES = [((5, 17), 33), ((3, 7, 65), 31), ((70, 1), 16), ((2, 19, 40), 45)]  # x, out


def inputs(xshape, out, dtype, bias=True):
    x = torch.randn(xshape)
    w = torch.randn(out, xshape[-1]) / xshape[-1] ** 0.5
    b = torch.randn(out) if bias else None
    return [t.to(dtype) if t is not None else None for t in (x, w, b)]


def run(fn, x, w, b, act, dy, **kw):
    """Output and the gradients of x, weight and bias of fn(x, w, b, act) for upstream dy."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves, act, **kw)
    y.backward(dy)
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def assert_all_close(got, ref, dtype, x, w, b, dy):
    rtol = TOL[dtype]
    ax, aw, ady = (t.float().abs().reshape(-1, t.shape[-1]) for t in (x, w, dy))
    terms = [ax @ aw.t() + (b.float().abs() if b is not None else 0), ady @ aw, ady.t() @ ax,
             ady.sum(0)]  # S: magnitudes of the terms each result sums
    for name, g, r, s in zip(("y", "dx", "dweight", "dbias"), got, ref, terms):
        if r is None:
            assert g is None, name
            continue
        assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, g.shape, r.shape)
        g, r = g.float().reshape(s.shape), r.float().reshape(s.shape)
        excess = (g - r).abs() / (rtol * (r.abs() + s))
        assert not excess.numel() or excess.max() <= 1, (
            f"{name}: {(excess > 1).sum()} of {r.numel()} outside rtol {rtol}; worst at "
            f"{divmod(int(excess.argmax()), s.shape[-1])}: {g.flatten()[excess.argmax()]} vs "
            f"{r.flatten()[excess.argmax()]}, terms {s.flatten()[excess.argmax()]}")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("xshape,out", SHAPES)
def test_triton_matches_reference(xshape, out, act, dtype):
    x, w, b = inputs(xshape, out, dtype)
    dy = torch.randn(*xshape[:-1], out).to(dtype)
    got = run(linear.linear_act, x, w, b, act, dy, backend="triton")
    assert_all_close(got, run(linear.linear_act_ref, x, w, b, act, dy), dtype, x, w, b, dy)


@needs_triton
@pytest.mark.parametrize("act", ACTS)
def test_triton_without_bias(act):
    x, w, _ = inputs((9, 40), 23, torch.float32)
    dy = torch.randn(9, 23)
    got = run(linear.linear_act, x, w, None, act, dy, backend="triton")
    assert_all_close(got, run(linear.linear_act_ref, x, w, None, act, dy), torch.float32,
                     x, w, None, dy)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_transposed_operands(dtype):
    # x, weight and dy as transposed views: the kernel addresses them through their strides
    x = torch.randn(45, 19).to(dtype).t()  # (19, 45), strides (1, 19)
    w = (torch.randn(45, 37) / 45 ** 0.5).to(dtype).t()  # weight [37, 45] stored as [in, out]
    b = torch.randn(37).to(dtype)
    dy = torch.randn(37, 19).to(dtype).t()
    assert not (x.is_contiguous() or w.is_contiguous() or dy.is_contiguous())
    got = run(linear.linear_act, x, w, b, "gelu", dy, backend="triton")
    assert_all_close(got, run(linear.linear_act_ref, x, w, b, "gelu", dy), dtype, x, w, b, dy)


@needs_triton
def test_triton_partial_grads_and_empty_batch():
    # frozen weight (db without the dW GEMM), input without grad, and zero tokens
    x, w, b = inputs((6, 20), 18, torch.float32)
    dy = torch.randn(6, 18)
    bl = b.clone().requires_grad_()
    linear.linear_act(x, w, bl, "gelu_tanh", backend="triton").backward(dy)
    ref = bl.grad.clone()
    bl.grad = None
    linear.linear_act_ref(x, w, bl, "gelu_tanh").backward(dy)
    torch.testing.assert_close(ref, bl.grad, rtol=1e-4, atol=1e-4)
    x0 = torch.randn(0, 20)
    got = run(linear.linear_act, x0, w, b, "gelu", torch.randn(0, 18), backend="triton")
    assert got[0].shape == (0, 18)
    assert torch.equal(got[2], torch.zeros_like(w)) and torch.equal(got[3], torch.zeros_like(b))


def graph(y):
    """Names of the autograd nodes behind y."""
    names, todo = set(), [y.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None:
            names.add(type(f).__name__)
            todo += [g for g, _ in f.next_functions]
    return names


@needs_triton
def test_env_var_selects_triton(monkeypatch):
    x, w, b = inputs((4, 16), 16, torch.float32)
    monkeypatch.setenv("PYFAST_BACKEND", "triton")
    y = linear.linear_act(x.requires_grad_(), w, b, "gelu")
    assert "_LinearActTritonBackward" in graph(y)
    monkeypatch.delenv("PYFAST_BACKEND")
    y = linear.linear_act(x, w, b, "gelu")  # automatic choice on CPU: torch's GEMM + epilogue
    names = graph(y)
    assert {"AddmmBackward0", "GeluBackward0"} <= names and "_LinearActTritonBackward" not in names


def linear_then_gelu(x, w, b, act):
    """What linear_act promises, spelled with the torch ops users know (not linear_act_ref)."""
    y = torch.nn.functional.linear(x, w, b)
    return torch.nn.functional.gelu(y, approximate={"gelu": "none", "gelu_tanh": "tanh"}[act]) \
        if act else y


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("backend", backend_params() + ["torch"])
def test_cpu_path_is_the_reference(backend, act):
    """On CPU linear_act is linear_act_ref (bitwise), and both compute F.linear then F.gelu:
    the output and every gradient, within the bound above (another GEMM, another sum order)."""
    x, w, b = inputs((3, 5, 24), 40, torch.float32)
    dy = torch.randn(3, 5, 40)
    if backend == "triton":
        pytest.skip("compared with tolerances above")
    got = run(linear.linear_act, x, w, b, act, dy, backend=backend)
    for g, r in zip(got, run(linear.linear_act_ref, x, w, b, act, dy)):
        assert torch.equal(g, r)
    assert_all_close(got, run(linear_then_gelu, x, w, b, act, dy), torch.float32, x, w, b, dy)


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
def test_bad_inputs(backend):
    x, w, b = inputs((4, 16), 8, torch.float32)
    with pytest.raises(ValueError, match=r"\(4, 15\).*\(8, 16\)"):
        linear.linear_act(x[:, :15], w, b, backend=backend)
    with pytest.raises(ValueError, match=r"\(7,\).*\[8\]"):
        linear.linear_act(x, w, b[:7], backend=backend)
    with pytest.raises(ValueError, match="valid: None, 'gelu', 'gelu_tanh'"):
        linear.linear_act(x, w, b, "relu", backend=backend)
    with pytest.raises(TypeError, match="x torch.float32, weight torch.bfloat16"):
        linear.linear_act(x, w.bfloat16(), b, backend=backend)
    with pytest.raises(TypeError, match="float64"):
        linear.linear_act(x.double(), w.double(), b.double(), backend=backend)


@pytest.mark.parametrize("backend", backend_params() + ["torch"])
def test_autocast_computes_what_f_linear_computes(backend):
    """Under bf16 autocast linear_act casts x, weight and bias as F.linear does and runs its
    GEMM and epilogue in bf16 (an autograd Function is not intercepted by autocast: the Triton
    path ran in fp32 before). Gradients reach the fp32 leaves in fp32."""
    import torch.nn.functional as F
    x, w, b = inputs((2, 7, 33), 18, torch.float32)
    dy = torch.randn(2, 7, 18)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(linear.linear_act, x, w, b, "gelu", dy, backend=backend)
        ref = run(lambda x, w, b, act: F.gelu(F.linear(x, w, b)), x, w, b, "gelu", dy)
    dtypes = [torch.bfloat16] + [torch.float32] * 3
    assert [t.dtype for t in got] == [t.dtype for t in ref] == dtypes
    xb, wb, bb = (t.bfloat16() for t in (x, w, b))
    assert_all_close([got[0]], [ref[0]], torch.bfloat16, xb, wb, bb, dy.bfloat16())
    for g, r in zip(got[1:], ref[1:]):  # bf16 GEMMs on both sides, then widened
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)


GEMM_CASES = [  # (device, x, weight, bias dtype, PYFAST_BACKEND) -> Triton's GEMM or torch's
    ("cuda", torch.float32, torch.float32, torch.float32, None, "triton"),
    ("cuda", torch.bfloat16, torch.bfloat16, None, None, "triton"),
    ("cuda", torch.float16, torch.float16, torch.float16, None, "triton"),
    ("cuda", torch.float64, torch.float64, torch.float64, None, "torch"),  # cuBLAS
    ("cuda", torch.bfloat16, torch.float32, None, None, "torch"),  # mixed: F.linear's rules
    ("cuda", torch.bfloat16, torch.bfloat16, torch.float32, None, "torch"),
    ("cuda", torch.float32, torch.float32, None, "torch", "torch"),
    ("cpu", torch.float32, torch.float32, None, None, "torch"),  # MKL: the CPU fast path
    ("cpu", torch.bfloat16, torch.bfloat16, None, "triton", "triton"),  # forced: interpreter
    ("cpu", torch.float32, torch.float32, None, "cpp", "torch"),
]


@needs_triton
@pytest.mark.parametrize("device,xd,wd,bd,forced,want", GEMM_CASES)
def test_gemm_backend_uses_triton_only_where_its_dtypes_hold(monkeypatch, device, xd, wd, bd,
                                                             forced, want):
    """The tensor-parallel layers' GEMM choice, decided without a GPU (a CUDA device object
    needs none). Forced triton with dtypes it cannot take fails loudly, never falls back."""
    if forced is None:
        monkeypatch.delenv("PYFAST_BACKEND", raising=False)
    else:
        monkeypatch.setenv("PYFAST_BACKEND", forced)
    assert linear.gemm_backend(torch.device(device), xd, wd, bd) == want
    if forced == "triton":
        with pytest.raises(linear.BackendUnavailable, match="float64"):
            linear.gemm_backend(torch.device(device), torch.float64, torch.float64)


def test_tp_layers_take_the_gemm_that_gemm_backend_picks(monkeypatch):
    """ColumnParallelLinear's local GEMM follows gemm_backend: linear_act (Triton) when it
    says so, torch's F.linear otherwise."""
    from pyfast.parallel import tensor
    calls = []
    monkeypatch.setattr(tensor, "linear_act", lambda x, w, b: calls.append("triton") or x @ w.t())
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    monkeypatch.setattr(tensor, "gemm_backend", lambda *a: "triton")
    tensor._linear(x, w)
    monkeypatch.setattr(tensor, "gemm_backend", lambda *a: "torch")
    tensor._linear(x, w)
    assert calls == ["triton"]
