"""linear_act(x, weight, bias, activation) = act(x @ weight^T + bias), nn.Linear's convention
(weight [out, in], x [..., in]), with act None, "gelu" (erf) or "gelu_tanh": the GEMMs of the
sharded MLPs. `linear_act_ref` is the torch reference (addmm + F.gelu); kernels/matmul.py has
the Triton kernels (matmul with a fused bias/GELU epilogue, the GELU backward).

Backends: triton for CUDA tensors (and for CPU tensors in Triton's interpreter when forced, as
the tests do), an autograd Function whose backward reuses the kernel on transposed views:
dz = dy * act'(z), dx = dz @ W, dW = dz^T @ x with db = dz.sum(0) fused into that GEMM.
On CPU, "cpp" and "torch" both run the reference: torch's GEMM (MKL) and its epilogue.

Under autocast linear_act computes what F.linear does there: x, weight and bias cast to the
autocast dtype (fp32/fp16/bf16 ones; float64 stays), the GEMM and epilogue in that dtype. An
autograd Function is not intercepted by autocast, so without this the Triton path would run
in fp32 where the dense layer runs in bf16.

`gemm_backend(device, dtypes)` decides between the Triton GEMM and torch's (cuBLAS on CUDA, MKL
on CPU) for the tensor-parallel layers: Triton on CUDA (or when forced) only where its dtype
rules hold (one dtype of DTYPES for x, weight and bias), else torch's.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from pyfast.ops._backend import BackendUnavailable, resolve

ACTIVATIONS = {None: None, "gelu": "none", "gelu_tanh": "tanh"}  # name -> F.gelu's approximate
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# CPU: no C++ epilogue, torch's addmm + F.gelu. Measured with bench/epilogue.py
# (bench/results/epilogue.txt; AMD EPYC, 2 cores, torch 2.13.0, 1 thread, fp32, 2048 tokens,
# medians of 21): 1024 -> 4096 + GELU, the forward GEMM alone 195 ms, addmm + gelu 216 ms
# (F.linear the same, matmul + add + gelu 231). A fused C++ bias+GELU pass does that epilogue
# in 5 ms in place, but training keeps z: then it costs 25 ms against torch's 20; backward,
# gelu' fused with db's column sum 23 ms against 25. Forward+backward of the layer: 603 ms
# with torch, 611 ms with both fused passes (-1.3%; +1.0% in an earlier run); 4096 -> 1024
# without activation, where only the bias is left to fuse: 0.2%. Under the 3% bar.


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; valid: "
                         f"{', '.join(repr(a) for a in ACTIVATIONS)}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_act: x {tuple(x.shape)} does not fit weight "
                         f"{tuple(weight.shape)}: weight is [out, in] and x is [..., in]")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_act: bias {tuple(bias.shape)} must be [{weight.shape[0]}] for "
                         f"weight {tuple(weight.shape)}")
    ts = {"x": x, "weight": weight, "bias": bias}
    given = {k: t for k, t in ts.items() if t is not None}
    if len({t.dtype for t in given.values()}) > 1 or x.dtype not in DTYPES:
        raise TypeError("linear_act takes one dtype of float32, bfloat16 or float16, got "
                        + ", ".join(f"{k} {t.dtype}" for k, t in given.items()))
    if len({t.device for t in given.values()}) > 1:
        raise ValueError("linear_act: tensors on different devices: "
                         + ", ".join(f"{k} {t.device}" for k, t in given.items()))


def linear_act_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   activation: str | None = None) -> torch.Tensor:
    _check(x, weight, bias, activation)
    x2 = x.reshape(-1, x.shape[-1])
    z = torch.addmm(bias, x2, weight.t()) if bias is not None else torch.mm(x2, weight.t())
    y = F.gelu(z, approximate=ACTIVATIONS[activation]) if activation else z
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _LinearActTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, activation):
        from pyfast.kernels import matmul as tk
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        pre = None
        if activation is not None and (need_x or need_w or need_b):  # z, for act'(z)
            pre = torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
        y = tk.matmul(x2, weight.t(), bias, activation, pre=pre)
        ctx.activation = activation
        ctx.save_for_backward(x2 if need_w else None, weight if need_x else None, pre)
        return y

    @staticmethod
    def backward(ctx, dy):
        from pyfast.kernels import matmul as tk
        x2, weight, pre = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dz = tk.gelu_grad(dy, pre, ctx.activation) if ctx.activation else dy
        dx = tk.matmul(dz, weight) if need_x else None
        dw = db = None
        if need_w:
            rowsum = torch.empty(dz.shape[1], dtype=torch.float32, device=dz.device) \
                if need_b else None
            dw = tk.matmul(dz.t(), x2, rowsum=rowsum)
            db = rowsum.to(dz.dtype) if need_b else None
        elif need_b:  # frozen weight: no dW GEMM to carry the sum
            db = dz.sum(0, dtype=torch.float32).to(dz.dtype)
        return dx, dw, db, None


def _use_triton(device: torch.device, backend: str | None) -> bool:
    name = backend or os.environ.get("PYFAST_BACKEND") or "auto"
    if name == "auto" and device.type == "cpu":
        return False  # torch's GEMM is the CPU fast path: it needs no pyfast._C, so no warning
    return resolve(device, backend) == "triton"


_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # what autocast lowers


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs F.linear in on `device_type` now, or None (autocast off)."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_linear_args(*ts: torch.Tensor | None):
    """(tensors as F.linear would see them under the current autocast, a context that turns
    autocast off): so a custom GEMM computes what F.linear computes, once, in that dtype. The
    casts are differentiable (gradients reach fp32 parameters in fp32, as with autocast)."""
    first = next(t for t in ts if t is not None)
    dt = autocast_dtype(first.device.type)
    if dt is None:
        return ts, contextlib.nullcontext()
    cast = tuple(t.to(dt) if t is not None and t.dtype in _AUTOCAST_CASTS else t for t in ts)
    return cast, torch.autocast(first.device.type, enabled=False)


def gemm_backend(device: torch.device, x_dtype: torch.dtype, w_dtype: torch.dtype,
                 b_dtype: torch.dtype | None = None, backend: str | None = None) -> str:
    """"triton" or "torch": which GEMM a tensor-parallel layer runs for these (post-autocast)
    dtypes on `device`. Automatic: Triton on CUDA where its dtype rules hold (x, weight and
    bias of one dtype in DTYPES), else torch's (cuBLAS; on CPU, MKL, which a fused epilogue
    did not beat: see above). Forced (PYFAST_BACKEND / backend): "triton" raises
    BackendUnavailable naming the dtypes it cannot take; "cpp" and "torch" run torch's."""
    name = backend or os.environ.get("PYFAST_BACKEND") or "auto"
    dtypes = {x_dtype, w_dtype} | ({b_dtype} if b_dtype is not None else set())
    fits = len(dtypes) == 1 and x_dtype in DTYPES
    if name == "auto":
        if device.type != "cuda" or not fits:
            return "torch"
        return "triton" if resolve(device, backend) == "triton" else "torch"
    if resolve(device, backend) != "triton":
        return "torch"
    if not fits:
        raise BackendUnavailable(
            f"backend 'triton' was asked for but its GEMM takes one dtype of "
            f"{', '.join(str(d) for d in DTYPES)} for x, weight and bias, got x {x_dtype}, "
            f"weight {w_dtype}" + (f", bias {b_dtype}" if b_dtype is not None else ""))
    return "triton"


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str | None = None, backend: str | None = None) -> torch.Tensor:
    """act(x @ weight^T + bias) for x [..., in], weight [out, in], bias [out]; differentiable.
    Under autocast: in the autocast dtype, as F.linear (then the activation in that dtype)."""
    (x, weight, bias), no_autocast = autocast_linear_args(x, weight, bias)
    with no_autocast:
        _check(x, weight, bias, activation)
        if not _use_triton(x.device, backend):
            return linear_act_ref(x, weight, bias, activation)
        y = _LinearActTriton.apply(x.reshape(-1, x.shape[-1]), weight, bias, activation)
        return y.view(*x.shape[:-1], weight.shape[0])
