"""Hugging Face causal LMs behind the model contract of pyfast.models (tp_plan, tp_check,
retie, enable_activation_checkpointing, forward(ids) -> logits [B, T, vocab / tp]).

`llama_tiny` wraps a randomly initialised `transformers` LlamaForCausalLM (nothing is
downloaded) with grouped-query attention (4 query heads, 2 key/value heads), so the TP plan is
exercised on GQA. The HF code runs unmodified under parallelize(); why that is right:

- LlamaAttention reshapes q/k/v with view(..., -1, head_dim) and the output with
  reshape(..., -1), so a column shard of q/k/v_proj gives heads/tp and kv_heads/tp local heads
  without telling it. Its num_key_value_groups (heads // kv_heads, set from the config) is the
  same ratio locally, and the contiguous split keeps query head i with key/value head
  i // groups on one rank: rank r holds q heads [r*h/tp, (r+1)*h/tp) and kv heads
  [r*kv/tp, (r+1)*kv/tp). It needs kv_heads % tp == 0 (replicating kv heads is not done).
- The rotary tables use config.head_dim, which TP does not change; config.vocab_size is read
  only by the HF loss, and the adapter never passes labels (the job computes a
  vocab-parallel loss).
Before transformers 4.48 Llama's attention viewed q/k/v with its stored num_heads (the
config's), which fails under TP: pyproject's `hf` extra asks for 4.48 or later.
"""
from __future__ import annotations

import torch
from torch import nn

_NEEDS = ("--model hf-llama-tiny needs the Hugging Face transformers package: "
          "pip install 'pyfast[hf]'  (or pip install transformers)")

# Megatron's split of a Llama block; names are the adapter's ("hf." + HF's own module names)
LLAMA_TP_PLAN = {
    "hf.model.layers.*.self_attn.q_proj": "colwise",
    "hf.model.layers.*.self_attn.k_proj": "colwise",
    "hf.model.layers.*.self_attn.v_proj": "colwise",
    "hf.model.layers.*.self_attn.o_proj": "rowwise",
    "hf.model.layers.*.mlp.gate_proj": "colwise",
    "hf.model.layers.*.mlp.up_proj": "colwise",
    "hf.model.layers.*.mlp.down_proj": "rowwise",
    "hf.model.embed_tokens": "vocab",
    "hf.lm_head": "colwise",  # gather_output=False: logits stay vocabulary-sharded
}
# config fields that TP divides, in the order tp_check reports them
LLAMA_TP_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                   "vocab_size")


class HFCausalLM(nn.Module):
    """A transformers *ForCausalLM as a pyfast model; `plan` and `fields` say how to split it."""

    def __init__(self, hf: nn.Module, plan: dict, fields: tuple[str, ...]):
        super().__init__()
        self.hf, self._plan, self._fields = hf, plan, fields
        self.config = hf.config

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids).logits

    vocab_parallel = True  # the plan splits embed_tokens and lm_head

    def tp_plan(self) -> dict:
        return dict(self._plan)

    def tp_check(self, tp: int) -> str | None:
        """Why this model cannot be split over tp ranks, or None."""
        for field in self._fields:
            n = getattr(self.config, field)
            if n % tp:
                return f"{type(self.config).__name__}: {field} {n} is not divisible by tp={tp}"
        return None

    def retie(self) -> None:
        """After parallelize the embedding and the head are two converted copies of one table;
        VocabParallelEmbedding and ColumnParallelLinear own the same rows, so share them."""
        if self.config.tie_word_embeddings:
            self.hf.lm_head.weight = self.hf.get_input_embeddings().weight

    def context_parallel(self, group, layout: str | None = None, method: str = "ring") -> None:
        """GPT.context_parallel's contract: forward takes this rank's shard of the ids (layout:
        required, the one they were sharded with) and returns its tokens' logits; attention
        runs over the whole sequence (ring or ulysses) through transformers' attention
        interface and positions are the shard's global ones (pyfast.models.hf_attention)."""
        from .hf_attention import enable
        enable(self, group, layout, method)

    def cp_check(self) -> str | None:
        """Why context_parallel would refuse this model, or None."""
        from .hf_attention import problem
        return problem(self.hf)

    def as_sequential(self) -> nn.Module:
        """The same modules as an nn.Sequential [embedding, layers..., head] for
        Pipeline.from_sequential, keeping HF's parameter names (pyfast.models.hf_stages)."""
        from .hf_stages import HFStages
        return HFStages(self)

    def enable_activation_checkpointing(self) -> None:
        # transformers 5 renamed gradient_checkpointing_enable (the old name warns there).
        # Non-reentrant, as GPT's blocks: no input needs requires_grad. Unlike GPT, HF's
        # layers recompute only in train() mode, not whenever grad is enabled.
        kwargs = {"use_reentrant": False}
        if hasattr(self.hf, "activation_checkpointing_enable"):
            self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def llama_tiny(vocab_size: int, seq_len: int, positions: str = "rotary",
               tie_embeddings: bool = False) -> HFCausalLM:
    """A 2-layer Llama (hidden 64, 4 heads, 2 kv heads, MLP 176 so tp 2 and 4 divide it),
    initialised by HF (normal(0, 0.02)) from torch's default generator: seed it first."""
    if positions != "rotary":
        raise ValueError(f"hf-llama-tiny has rotary positions only, got positions={positions!r}")
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ImportError(_NEEDS) from e
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                         max_position_embeddings=seq_len, use_cache=False, pad_token_id=None,
                         tie_word_embeddings=tie_embeddings, attn_implementation="sdpa")
    return HFCausalLM(LlamaForCausalLM(config), LLAMA_TP_PLAN, LLAMA_TP_FIELDS)
