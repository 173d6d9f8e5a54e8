"""One module per op, each with a torch reference beside its entry points (docs/FORMATS.md):
`pyfast.ops.quantize` (quantize / dequantize / dequantize_accumulate_ for int8, int4, fp8,
sign), `pyfast.ops.topk` (topk, with topk_count / topk_select kernels) and `pyfast.ops.linear`
(linear_act: act(x @ W^T + b) with a fused bias/GELU epilogue, differentiable)."""
from pyfast.ops import linear, quantize, topk
from pyfast.ops._backend import BACKENDS, BackendUnavailable, resolve, status
from pyfast.ops.linear import linear_act

__all__ = ["BACKENDS", "BackendUnavailable", "resolve", "status", "linear_act", "linear",
           "quantize", "topk"]
