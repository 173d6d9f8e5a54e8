"""A frozen base stored low-precision: QuantLinear, and quantize_base(model, fmt) that puts it
under the LoRA adapters of a model (QLoRA's frozen 4-bit base; bf16 and int8 beside it).

Formats (`--base-dtype`):
- "bf16": the weight cast to bfloat16 (2 bytes a parameter).
- "int8": blockwise absmax int8 (pyfast.ops.quantize kind "int8", blocks of BLOCK elements, an
  fp32 scale each: 8.5 bits a parameter at 64).
- "nf4": QLoRA's NormalFloat4 codebook, blockwise absmax (ops.quantize kind "nf4", two codes a
  byte, an fp32 scale per BLOCK elements: 4.5 bits a parameter at 64).
The weight is quantized once, when the base is converted, and never again: `codes` and `scales`
are frozen nn.Parameters (requires_grad=False, never in an optimizer, never reduced) that
ZeRO-3 shards and all-gathers as they are (packed bytes), and forward dequantizes the whole
weight into the input's dtype just before the matmul, then drops it.

The base layer's bias and the other frozen parameters (embeddings, norms, the head) keep
their dtype here; the job stores them in bf16 under --precision bf16 (a frozen tensor is only
read), so a frozen base is never silently kept in fp32 (accelerate#3844).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FORMATS = ("bf16", "int8", "nf4")
BLOCK = 64  # QLoRA's block for NF4 (the paper's 64); int8 uses the same


class QuantLinear(nn.Module):
    """A frozen nn.Linear whose weight is kept in `fmt` (module docstring). forward(x) =
    F.linear(x, dequantized weight in x's dtype, bias)."""

    def __init__(self, linear: nn.Linear, fmt: str, block: int = BLOCK):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"base format must be one of {FORMATS}, got {fmt!r}")
        w = linear.weight.detach()
        self.fmt, self.block = fmt, block
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.shape = tuple(w.shape)
        codes, scales = quantize_weight(w, fmt, block)
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        b = linear.bias
        self.bias = None if b is None else nn.Parameter(b.detach(), requires_grad=False)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        """The full weight [out, in] in dtype."""
        return dequantize_weight(self.codes, self.scales, self.shape, self.fmt, self.block,
                                 dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (fp32): what peft's merge and the exporters read."""
        return self.dequantized(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # autocast's, where it runs (it knows no meta device: a dry run's)
        if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.dequantized(dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"fmt={self.fmt}, block={self.block}"


def quantize_weight(w: torch.Tensor, fmt: str, block: int = BLOCK):
    """(codes, scales) of a weight: bf16 -> (w as bf16, empty scales)."""
    if fmt == "bf16":
        return w.to(torch.bfloat16).contiguous(), torch.empty(0, device=w.device)
    from pyfast.ops.quantize import quantize
    if w.device.type == "meta":  # a dry run: the right sizes, no values
        from pyfast.ops.quantize import codes_len, scales_len
        n = w.numel()
        return (torch.empty(codes_len(n, fmt), dtype=torch.uint8, device=w.device),
                torch.empty(scales_len(n, block), dtype=torch.float32, device=w.device))
    return quantize(w.reshape(-1).to(torch.float32), fmt, block)


def dequantize_weight(codes, scales, shape, fmt: str, block: int = BLOCK,
                      dtype=torch.float32) -> torch.Tensor:
    if fmt == "bf16":
        return codes.to(dtype).view(shape)
    if codes.device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=codes.device)
    from pyfast.ops.quantize import dequantize
    n = 1
    for s in shape:
        n *= s
    return dequantize(codes, scales, n, fmt, block, dtype).view(shape)


def quantize_base(model: nn.Module, fmt: str, block: int = BLOCK) -> list[str]:
    """Convert the frozen base of a LoRA model (pyfast.models.lora.apply_lora) in place: every
    adapted module's base_layer becomes a QuantLinear in `fmt`. Returns the names of the converted base layers. ValueError without LoRA."""
    if fmt not in FORMATS:
        raise ValueError(f"--base-dtype must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if getattr(model, "lora", None) is None:
        raise ValueError(f"--base-dtype {fmt}: the base is frozen only under LoRA adapters "
                         "(--lora R); a full fine-tune trains every weight")
    done = []
    for name, m in list(model.named_modules()):
        base = getattr(m, "base_layer", None)
        if isinstance(base, nn.Linear) and hasattr(m, "lora_A"):
            m.base_layer = QuantLinear(base, fmt, block)
            done.append(name)
    return done


__all__ = ["BLOCK", "FORMATS", "QuantLinear", "dequantize_weight", "quantize_base",
           "quantize_weight"]
