"""pyfast.optim.AdamW: torch.optim.AdamW's step in one fused pass per parameter group
(pyfast.ops.adamw_: the C++ kernel on CPU tensors, 28 bytes moved per fp32 parameter; the torch
reference on CUDA, its fake on meta), a drop-in torch.optim.Optimizer.

Same semantics and state as torch.optim.AdamW (decoupled weight decay, bias correction, state
keys "step" (a 0-d fp32 tensor), "exp_avg", "exp_avg_sq"), so state dicts load into either and
training continues (tests/test_adamw.py). Differences, on purpose:
- the moments are fp32 for every parameter dtype: a bf16 parameter is updated in fp32 and
  rounded once to bf16 (torch keeps bf16 moments for bf16 parameters and rounds each op);
  a bf16 state loaded from torch is widened to fp32;
- `max_norm` clips by the global 2-norm of this optimizer's gradients, torch's clip_grad_norm_
  rule (coefficient min(1, max_norm / (norm + 1e-6))), folded into the pass as a gradient
  scale instead of a pass of its own; the norm is left in `self.grad_norm`;
- `step(grad_scale=s)` multiplies every gradient by s (a float or a 0-d tensor: 1/loss-scale)
  inside the same pass; the clip norm is taken of the scaled gradients.
amsgrad, maximize, capturable, differentiable, foreach/fused and complex parameters are refused.
"""
from __future__ import annotations

import functools

import torch

from pyfast.ops.adamw import PARAM_DTYPES, adamw_

_REFUSED = ("amsgrad", "maximize", "capturable", "differentiable")


@functools.cache
def _torch_group() -> dict:
    """torch.optim.AdamW's other param-group keys at torch's defaults (amsgrad False, foreach
    None, decoupled_weight_decay True, ...), carried in every group so that a state dict of either
    optimizer has every key of the other's: DCP loads a checkpoint only if it holds each key the
    target asks for (pyfast export loads a --zero job's checkpoint into torch's AdamW). Read from
    a torch AdamW on first use, not at import: building an optimizer touches torch.cuda, which
    the launcher's forkserver must not do before it forks ranks (tests/test_launch_fork.py)."""
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return {k: v for k, v in opt.defaults.items() if k not in ("lr", "betas", "eps", "weight_decay")}


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 max_norm=None, **torch_only):
        for k, v in torch_only.items():
            if k in _REFUSED + ("foreach", "fused") and not v:
                continue  # amsgrad=False etc.: what this optimizer does anyway
            raise ValueError(f"pyfast.optim.AdamW does not support {k}={v!r} (it implements "
                             "torch.optim.AdamW without amsgrad, maximize, capturable, "
                             "differentiable; its own pass replaces foreach/fused)")
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be positive or None, got {max_norm}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        **_torch_group())
        super().__init__(params, defaults)
        self.max_norm = max_norm
        self.grad_norm = None
        for group in self.param_groups:
            self._check_group(group)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if hasattr(self, "max_norm"):  # after __init__: torch's __init__ calls this too
            self._check_group(self.param_groups[-1])

    @staticmethod
    def _check_group(group) -> None:
        # a state dict saved by torch's AdamW brings its options: one this pass does not do
        on = [k for k in _REFUSED if group.get(k)]
        if on or not group.get("decoupled_weight_decay", True):
            what = ", ".join(on) or "coupled weight decay"
            raise ValueError(f"pyfast.optim.AdamW does not support {what} (a parameter group "
                             "asks for it: loaded from torch's optimizer?)")
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if not (0.0 <= float(lr) and 0.0 <= eps and 0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0
                and 0.0 <= wd):
            raise ValueError(f"invalid AdamW group: lr={lr}, betas=({b1}, {b2}), eps={eps}, "
                             f"weight_decay={wd} (need lr, eps, wd >= 0 and betas in [0, 1))")
        for p in group["params"]:
            if torch.is_complex(p) or p.dtype not in PARAM_DTYPES:
                raise ValueError(f"pyfast.optim.AdamW takes float32 or bfloat16 parameters, got "
                                 f"{p.dtype} (shape {tuple(p.shape)})")

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            self._check_group(group)
        # torch casts a loaded state to the parameter's dtype; this optimizer's moments are fp32
        for st in self.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    st[k] = st[k].to(torch.float32).contiguous()

    def _grads(self):
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _clip_scale(self, grad_scale):
        grads = self._grads()
        if not grads:
            return grad_scale
        if any(g.is_sparse for g in grads):
            raise ValueError("pyfast.optim.AdamW does not take sparse gradients")
        # torch.nn.utils.clip_grad_norm_'s norm: per-tensor norms, then the norm of those
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)))
        if not isinstance(grad_scale, torch.Tensor) and grad_scale == 1.0:
            self.grad_norm = norm
            return torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        self.grad_norm = norm * grad_scale
        return grad_scale * torch.clamp(self.max_norm / (self.grad_norm + 1e-6), max=1.0)

    @torch.no_grad()
    def step(self, closure=None, grad_scale=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = 1.0 if grad_scale is None else grad_scale
        if self.max_norm is not None:
            scale = self._clip_scale(scale)
        for group in self.param_groups:
            self._step_group(group, scale)
        return loss

    def _step_group(self, group, scale) -> None:
        beta1, beta2 = group["betas"]
        # one call per (step, device): a parameter that missed steps (no grad) has its own
        # count, as in torch
        by_step = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError("pyfast.optim.AdamW does not take sparse gradients")
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["step"] += 1
            by_step.setdefault((int(st["step"].item()), p.device), []).append(p)
        for (step, _), ps in by_step.items():
            # the kernel takes contiguous tensors; a strided parameter steps on a copy
            flat = [p if p.is_contiguous() else p.contiguous() for p in ps]
            adamw_(flat, [p.grad.contiguous() for p in ps],
                   [self.state[p]["exp_avg"] for p in ps],
                   [self.state[p]["exp_avg_sq"] for p in ps], step=step, lr=float(group["lr"]),
                   beta1=beta1, beta2=beta2, eps=group["eps"],
                   weight_decay=group["weight_decay"], grad_scale=scale)
            for p, f in zip(ps, flat):
                if f is not p:
                    p.copy_(f)


def job_adamw(groups, device, **kw) -> torch.optim.Optimizer:
    """The AdamW a training job steps with (pyfast.train.job; the planner's CPU probe times the
    same): this class where every parameter is on the CPU, fp32 or bf16, and pyfast._C has the
    kernel; torch.optim.AdamW otherwise (CUDA: its foreach default, where this class would run
    the per-tensor reference; meta: a dry run models the GPU job, which steps torch's).

    Why: on CPU tensors torch's AdamW defaults to its per-tensor loop (_single_tensor_adam, not
    foreach, which torch enables on CUDA only): 51 ms a step of gpt-small's 10.8M parameters in a
    2-rank dp job against one fused pass here (11.8 ms at 10M, bench/results/adamw.txt). The two
    differ in rounding only (pyfast.ops.adamw; tests/test_adamw.py states the bound), and their
    state dicts load into each other (bf16 parameters: fp32 moments here, module docstring)."""
    from pyfast.ops.adamw import kernel_built
    params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    ours = (device.type == "cpu" and kernel_built()
            and all(p.device.type == "cpu" and p.dtype in PARAM_DTYPES for p in params))
    return (AdamW if ours else torch.optim.AdamW)(groups, **kw)
