"""QuantLinear (pyfast.models.quant_base): the frozen base layer of QLoRA, against F.linear on
its dequantized weight, and what it keeps for backward."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyfast.models.lora import LoraOptions, apply_lora
from pyfast.models.quant_base import FORMATS, QuantLinear, quantize_base


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_input_gradient_equal_f_linear_on_the_dequantized_weight(fmt, bias):
    torch.manual_seed(0)
    lin = nn.Linear(100, 70, bias=bias)  # 7000 weights: not a multiple of the 64-block
    q = QuantLinear(lin, fmt)
    x = torch.randn(3, 5, 100, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = q(x)
    ref = F.linear(x2, q.dequantized(), None if q.bias is None else q.bias)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    # the same fp32 products; the input gradient is one matmul in another association
    # (g @ W vs autograd's mm of the transposed weight): fp32 rounding, 1e-5 relative
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    assert q.codes.grad is None and q.scales.grad is None


def test_backward_keeps_no_copy_of_the_weight():
    """F.linear on a dequantized weight would save the full fp32 weight for backward; the
    frozen base's function saves nothing (it dequantizes again)."""
    q = QuantLinear(nn.Linear(256, 512), "nf4")
    x = torch.randn(4, 256, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        q(x).sum().backward()
    assert sum(saved) < 256 * 512 // 4, saved  # nothing of the 131K-element weight


def test_quantize_base_needs_lora_and_a_known_format():
    m = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="--lora"):
        quantize_base(m, "nf4")
    from pyfast import models
    m = apply_lora(models.build("gpt-tiny", 64, 16), LoraOptions(2))
    with pytest.raises(ValueError, match="base-dtype"):
        quantize_base(m, "int4")
    names = quantize_base(m, "int8")
    assert names and all(isinstance(m.get_submodule(n).base_layer, QuantLinear) for n in names)
