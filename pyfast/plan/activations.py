"""What a transformer block saves for backward per token, and the memory kinds: shared by
memory.py (every plan) and finetune.py (LoRA plans), below both (no import cycle). Pure
arithmetic, no torch."""
from __future__ import annotations

from .spec import ModelShape

F32 = 4
KINDS = ("parameters", "gradients", "optimizer", "activations", "comm_buffers", "feedback")


def _block_saved(shape: ModelShape, tp: int, s_attn: int, device: str, cp_method: str,
                 cp: int, bpe: float, rows: int, sp: bool = False) -> tuple[float, float]:
    """(bytes one Block saves for backward per token, its largest backward temporary per
    token). Saved per token, h = hidden, f = ffn, a = heads, t = tp, fp32 (derived by listing
    the storages autograd keeps for pyfast.models.gpt.Block, Korthikanti's method):
      LayerNorms: input and output of each, h each (replicated over tp) + mean, rstd: 4h + 4
      MLP: fc output and GELU output, 2f/t
      attention, math SDPA (the dry run): q, k scaled, v contiguous, the proj input: 4h/t, and
        the softmax a s/t (s: the keys it attends to); with one sequence per micro-batch v is a
        view of the qkv output (b x heads merge without a copy), which then stays: +2h/t
      attention, flash SDPA / ring attention (cuda, cpu): q, k rotated 2h/t, the qkv output
        3h/t (v is a view of it), the output and the proj input 2h/t, log-sum-exp a/t.
    Temporaries of the backward: the MLP's 2f/t + 2h, the math softmax's 2 a s/t.
    sp (sequence parallelism, tp > 1): the LayerNorms run on the sequence shard and the column
    layers save that shard (tensor.py's _GatherLinear re-gathers it in backward): 4h/t + 4/t."""
    h, f, a = shape.hidden, shape.ffn, shape.heads
    kv = shape.kv_dim
    ln = (4 * h + 4) / (tp if sp else 1)  # fp32 even under autocast (layer_norm: an fp32 op)
    mlp = 2 * f / tp
    # the dry run sends attention to the memory-efficient kernel's op (train/meta_autocast.py,
    # since main's 34df39b), as a GPU runs it: "math" is left only for a caller that asks
    math_attn = device == "meta-math" and not (cp > 1 and cp_method == "ring")
    if math_attn:
        attn = (2 * h + (kv if rows > 1 else h + 2 * kv) + h) / tp
        soft = a * s_attn / tp
        if cp > 1:  # ulysses: all-to-all outputs, the output sent back
            attn += h / tp
    else:
        attn = (2 * h + (h + 2 * kv) + 2 * h) / tp + a / tp * (F32 / bpe)
        soft = 0.0
        if cp > 1 and cp_method == "ulysses":
            attn += h / tp
    saved = F32 * ln + bpe * (mlp + attn) + F32 * soft
    # the softmax's two s-wide temporaries come while the layer's MLP half (both LayerNorm-2
    # tensors, fc and GELU outputs, the proj input) is not made yet (forward) or freed already
    # (backward); the MLP's come with everything saved
    mlp_half = F32 * (2 * h + 2) + bpe * (2 * f + h) / tp
    temp = max(bpe * (2 * f / tp) + F32 * 2 * h, F32 * 2 * soft - mlp_half)
    return saved, temp


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, tp: int = 1, sp: bool = False,
                                 recompute: str = "none") -> float:
    """Activation bytes of one transformer layer per Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models", eqs. 1-4, 16-bit activations,
    dropout masks 1 byte): sbh(34 + 5as/h) without parallelism; tensor parallelism
    sbh(10 + 24/t + 5as/(ht)); with sequence parallelism sbh(34/t + 5as/(ht)); selective
    recompute drops the 5as/h attention term; full recompute keeps the layer input, 2sbh."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if recompute == "full":
        return 2.0 * s * b * h / (tp if sp else 1)
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / (h * tp)
    lin = 34.0 / tp if sp else 10.0 + 24.0 / tp
    return s * b * h * (lin + attn)
