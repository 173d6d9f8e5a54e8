"""One module per op, each with a torch reference beside its entry points (docs/FORMATS.md):
`pyfast.ops.quantize` (quantize / dequantize / dequantize_accumulate_ for int8, int4, fp8,
sign), `pyfast.ops.topk` (topk, with topk_count / topk_select kernels), `pyfast.ops.linear`
(linear_act: act(x @ W^T + b) with a fused bias/GELU epilogue, differentiable) and
`pyfast.ops.adamw` (adamw_: AdamW's step over lists of tensors in one pass, in place)."""
from pyfast.ops import linear, quantize, topk
from pyfast.ops._backend import BACKENDS, BackendUnavailable, resolve, status
from pyfast.ops.linear import linear_act

__all__ = ["BACKENDS", "BackendUnavailable", "resolve", "status", "linear_act", "linear",
           "quantize", "topk"]
