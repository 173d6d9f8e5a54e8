"""One module per op, each with a torch reference beside its entry points (docs/FORMATS.md):
`pyfast.ops.quantize` (quantize / dequantize / dequantize_accumulate_ for int8, int4, fp8,
sign) and `pyfast.ops.topk` (topk, with topk_count / topk_select kernels)."""
from pyfast.ops import quantize, topk
from pyfast.ops._backend import BACKENDS, BackendUnavailable, resolve, status

__all__ = ["BACKENDS", "BackendUnavailable", "resolve", "status", "quantize", "topk"]
