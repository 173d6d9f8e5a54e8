"""AdamW's step over lists of tensors, in place: `adamw_` (the C++ kernel csrc/adamw.cpp on CPU
tensors, its fake on meta, the reference elsewhere) and `adamw_reference_`, the torch reference
written in torch.optim.AdamW's single-tensor (foreach=False) order, op for op.

Parameters are fp32 or bf16, gradients the parameter's dtype or fp32, moments always fp32 (a
bf16 parameter is widened, updated in fp32 and rounded once to bf16, round-to-nearest-even).
`grad_scale` (a float or a one-element tensor) multiplies every gradient inside the pass: a
clip coefficient, or 1/loss-scale. The kernel and the reference differ only in rounding where
torch's own vector kernels fuse differently (an FMA in lerp; tests/test_adamw.py states the
bound). No Triton/CUDA twin: CUDA tensors take the reference (once-warned, as every op's
automatic fallback; PYFAST_BACKEND=cpp or triton on them raises BackendUnavailable).
"""
from __future__ import annotations


import torch

from pyfast.ops._backend import resolve_cpu_op

PARAM_DTYPES = (torch.float32, torch.bfloat16)


@torch.no_grad()  # an optimizer step: in place on leaves, never differentiated
def adamw_reference_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float,
                     grad_scale=1.0) -> None:
    """torch.optim.AdamW's _single_tensor_adam for one step (the lists' `step`, counted from
    1), with fp32 arithmetic for bf16 parameters and the gradient scaled first."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        pf = p if p.dtype == torch.float32 else p.float()
        g = g.float()
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            g = g * grad_scale
        if weight_decay != 0:
            pf.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        pf.addcdiv_(m, denom, value=-step_size)
        if pf is not p:
            p.copy_(pf)


def _check(params, grads, exp_avgs, exp_avg_sqs) -> None:
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(f"adamw_: the four lists must have one tensor per parameter; got {n} "
                         f"params, {len(grads)} grads, {len(exp_avgs)} exp_avgs, "
                         f"{len(exp_avg_sqs)} exp_avg_sqs")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"adamw_: params[{i}] is {p.dtype}; float32 or bfloat16 only")
        if g.dtype not in (p.dtype, torch.float32):
            raise TypeError(f"adamw_: grads[{i}] is {g.dtype}; it must be the parameter's "
                            f"dtype ({p.dtype}) or float32")
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            raise TypeError(f"adamw_: exp_avgs[{i}] and exp_avg_sqs[{i}] must be float32, got "
                            f"{m.dtype} and {v.dtype}")
        for name, t in (("grads", g), ("exp_avgs", m), ("exp_avg_sqs", v)):
            if t.numel() != p.numel() or t.device != p.device:
                raise ValueError(f"adamw_: {name}[{i}] has {t.numel()} elements on {t.device} "
                                 f"but params[{i}] has {p.numel()} on {p.device}")


def kernel_built() -> bool:
    """Whether adamw_ runs the C++ kernel on CPU tensors here: pyfast._C registered it and no
    PYFAST_BACKEND other than auto or cpp was asked for."""
    import os
    if (os.environ.get("PYFAST_BACKEND") or "auto") not in ("auto", "cpp"):
        return False
    try:
        import pyfast._C  # noqa: F401  (registers torch.ops.pyfast.*)
    except ImportError:  # not built: `make install`
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("pyfast::adamw_", "CPU")


def _backend(device: torch.device, backend: str | None) -> str:
    """cpp on CPU (the kernel) and meta (its fake); the reference elsewhere: no Triton/CUDA
    kernel. A backend asked for by name that cannot run here raises."""
    return resolve_cpu_op(device, backend, "adamw_", "adamw_", "adamw.cpp", ("cpu", "meta"))


@torch.no_grad()
def adamw_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float,
           beta2: float, eps: float, weight_decay: float, grad_scale=1.0,
           backend: str | None = None) -> None:
    """One AdamW step (`step` counted from 1) on every parameter of the lists, in place."""
    params, grads, exp_avgs, exp_avg_sqs = map(list, (params, grads, exp_avgs, exp_avg_sqs))
    _check(params, grads, exp_avgs, exp_avg_sqs)
    if not params:
        return
    kw = dict(step=int(step), lr=float(lr), beta1=float(beta1), beta2=float(beta2),
              eps=float(eps), weight_decay=float(weight_decay))
    if _backend(params[0].device, backend) == "torch":
        return adamw_reference_(params, grads, exp_avgs, exp_avg_sqs, grad_scale=grad_scale, **kw)
    t = grad_scale if isinstance(grad_scale, torch.Tensor) else None
    torch.ops.pyfast.adamw_(params, grads, exp_avgs, exp_avg_sqs, kw["step"], kw["lr"],
                            kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"], t,
                            1.0 if t is not None else float(grad_scale))
