"""bf16/fp16 autocast, fp16's GradScaler and GPU attention for the dry run's meta tensors.

torch.autocast casts only the tensors of its own device's dispatch key (AutocastCPU,
AutocastCUDA): a meta tensor passes through untouched, so a dry run of `--precision bf16` would
size every activation as fp32. MetaAutocast applies CUDA autocast's policy (what the dry run
sizes: a GPU's step) one level up, as a TorchFunctionMode above autograd, so the casts are
recorded and saved for backward exactly as autocast's are:
- LOWER ops (matmuls, linear, convolution, attention) run on low-precision copies of their
  floating inputs: their outputs and the copies autograd saves are bf16;
- FP32 ops (norms, softmax, the losses, exp/log/pow) run on fp32 copies;
- everything else runs as it is (type promotion: bf16 + fp32 -> fp32, as under autocast).
Attention: F.scaled_dot_product_attention on meta tensors takes torch's math path (two bmm and
a softmax that materialize, and save for backward, the [B, h, T, T] scores), while on a GPU it
runs a fused kernel that saves q, k, v, the output and a log-sum-exp: at 8B's shape, seq 2048,
the math path would add ~1 GiB a layer. MetaAutocast sends it to the memory-efficient kernel's
op (`_scaled_dot_product_efficient_attention`, which has meta kernels for forward and backward).
What it does not model: autocast's weight-cast cache (one bf16 copy of a weight per region
rather than one per use: the same bytes for a weight used once per forward, as every Linear
here is).
fp16 takes the same casts: CUDA autocast (and CPU's) lowers and keeps in fp32 the same ops for
fp16 as for bf16 (autocast_mode.cpp's lower_precision_fp and fp32 lists serve both dtypes).
Its GradScaler is MetaGradScaler below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from pyfast.comm.dry import read

LOWER = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
         torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm, F.conv1d, F.conv2d, F.conv3d,
         F.scaled_dot_product_attention}
LOSSES = {F.cross_entropy, F.nll_loss, F.mse_loss}
# torch's autocast_mode.cpp: CUDA runs norms, softmax and exp/log/pow in fp32 too; CPU only the
# losses (its layer_norm and softmax run in the input's dtype)
FP32 = {"cuda": LOSSES | {F.layer_norm, F.group_norm, F.rms_norm, torch.softmax, F.softmax,
                          torch.log_softmax, F.log_softmax, torch.exp, torch.log, torch.pow,
                          torch.Tensor.pow, torch.rsqrt, torch.Tensor.softmax,
                          torch.Tensor.log_softmax},
        "cpu": LOSSES}


class MetaAutocast(TorchFunctionMode):
    """with MetaAutocast(torch.bfloat16): forward on meta tensors, cast as `policy`'s autocast
    would ("cuda": what a dry run sizes; "cpu": checked against a real CPU autocast step);
    dtype None: no casts (fp32), attention still the fused kernel's."""

    def __init__(self, dtype: torch.dtype | None = torch.bfloat16, policy: str = "cuda"):
        super().__init__()
        self.dtype, self.fp32 = dtype, FP32[policy]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            func, args, kwargs = _fused_attention, self._cast(args, self.dtype), \
                self._cast(kwargs, self.dtype)
            return func(*args, **kwargs)
        to = self.dtype if func in LOWER else torch.float32 if func in self.fp32 else None
        to = None if self.dtype is None else to
        return func(*self._cast(args, to), **self._cast(kwargs, to))

    @staticmethod
    def _cast(tree, to):
        if to is None:
            return tree
        return tree_map(lambda t: t.to(to) if isinstance(t, torch.Tensor) and
                        t.is_floating_point() and t.dtype != to else t, tree)


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """F.scaled_dot_product_attention as the memory-efficient kernel (what a GPU saves)."""
    if k.shape[-3] != q.shape[-3]:  # grouped-query heads: the kernel takes them expanded
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)
    return out[0]


# the policy a dry run applies; tests set "cpu" to compare with a real CPU autocast step
POLICY = "cuda"


def autocast_forward(forward, dtype: torch.dtype | None):
    """forward, run under MetaAutocast(dtype, POLICY)."""
    def run(*args, **kwargs):
        with MetaAutocast(dtype, POLICY):
            return forward(*args, **kwargs)
    return run


class MetaGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler("meta") for an fp16 dry run: the same state (scale, growth tracker,
    one found_inf per device) and the same kernels, which have meta kernels: unscale_ checks and
    unscales the gradients in place (_amp_foreach_non_finite_check_and_unscale_: no bytes beyond
    the scalars), update runs _amp_update_scale_. Only its two host reads are replaced, as the
    dry step's own read is (Job._read: a finite step stands in, so every branch runs):
    get_scale gives the initial scale, and step takes the gradients as finite (found_inf is not
    read) and steps the optimizer. On tensors with values both are torch's own."""

    def __init__(self):
        super().__init__("meta")

    def get_scale(self) -> float:
        scale = self._get_scale_async()
        return self._init_scale if scale is None else read(scale, self._init_scale)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        flags = list(optimizer_state["found_inf_per_device"].values())
        if all(f.is_meta for f in flags):
            return optimizer.step(*args, **kwargs)
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
