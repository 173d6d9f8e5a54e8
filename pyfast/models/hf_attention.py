"""Context parallelism for Hugging Face causal LMs (HFCausalLM.context_parallel).

The HF code runs unmodified: its attention modules look their attention function up by name in
`transformers.AttentionInterface` (config._attn_implementation), so registering one more name,
"pyfast_cp", and switching the model to it routes every layer's attention through
pyfast.parallel.context.context_parallel_attention (ring or Ulysses; reached through
pyfast._sequence.attention(): models do not import parallel/), over the queries, keys
and values of this rank's shard of the sequence. Everything else in a decoder layer (norms,
projections, MLP) is per token. Positions are the shard's global ones (sequence_positions, the
layout the ids were sharded with): they are passed as position_ids to the HF model, whose
rotary module (Llama family) or learned table (GPT-2, wpe) turns them into the right angles or
vectors, exactly as on one process.

Masks: "pyfast_cp" has no mask function in transformers' AttentionMaskInterface, so the HF
model builds none (masking_utils skips custom implementations) and the attention is causal by
construction; a padding mask, attention dropout and a sliding window narrower than the sequence
are refused, not ignored (the window, only in the forward: it depends on the sequence length).
Grouped-query attention: context_parallel_attention takes as many key/value heads as query
heads, so k and v are expanded (query head i reads key/value head i // groups, HF's
repeat_kv) before the ring; the ring then moves groups x the keys and values it would need.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pyfast import _sequence
from pyfast._sequence import LAYOUTS, METHODS, sequence_positions

from .gpt import ContextParallel

NAME = "pyfast_cp"


def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature: q [B, H, S/N, D], k/v [B, KV, S/N, D] ->
    (output [B, S/N, H, D], no weights), causal attention over the whole sequence."""
    cp: ContextParallel | None = getattr(module, "pyfast_cp", None)
    what = type(module).__name__
    if cp is None:
        raise RuntimeError(f"{what}: attn_implementation {NAME!r} without context_parallel() "
                           "on the model (HFCausalLM.context_parallel sets the group)")
    if attention_mask is not None:
        raise ValueError(f"{what}: context-parallel attention is causal over whole sequences; "
                         "an attention mask (padding, packed documents) is not supported")
    if dropout:
        raise ValueError(f"{what}: attention dropout {dropout} is not supported under context "
                         "parallelism (set the config's attention dropout to 0)")
    window, world = kwargs.get("sliding_window"), dist.get_world_size(cp.group)
    if window is not None and window < query.shape[2] * world:  # a window this wide is causal
        raise ValueError(f"{what}: sliding-window attention ({window} tokens, in a sequence of "
                         f"{query.shape[2] * world}) is not supported under context parallelism")
    groups, rem = divmod(query.shape[1], key.shape[1])
    if rem:
        raise ValueError(f"{what}: {query.shape[1]} query heads are not a multiple of "
                         f"{key.shape[1]} key/value heads")
    if groups > 1:  # HF's repeat_kv: query head i attends with key/value head i // groups
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = cp.attention(query, key, value, cp.group, causal=True, method=cp.method,
                       layout=cp.layout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, cp_attention)  # idempotent: a dict entry


def attention_modules(hf: nn.Module) -> list[nn.Module]:
    """The self-attention modules of an HF model: those with HF's `is_causal` flag set."""
    return [m for m in hf.modules() if getattr(m, "is_causal", None) is True]


def problem(hf: nn.Module) -> str | None:
    """Why `hf` cannot run context-parallel attention, or None (before any rank starts:
    config.check_model, through HFCausalLM.cp_check)."""
    if not attention_modules(hf):
        return (f"{type(hf).__name__} has no causal attention module (HF's is_causal flag) to "
                "route through context-parallel attention")
    config = hf.config
    dropout = getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0)
    if dropout:
        return (f"{type(config).__name__} has attention dropout {dropout}, which "
                "context-parallel attention does not apply; set it to 0")
    return None


def enable(model, group, layout: str | None, method: str) -> ContextParallel:
    """Route `model.hf`'s attention through context_parallel_attention over `group` (see the
    module); returns the setting (HFStages.context_parallel reads it for its positions)."""
    if layout not in LAYOUTS or method not in METHODS:
        raise ValueError(f"context_parallel: layout must be one of {LAYOUTS} and method one "
                         f"of {METHODS}, got {layout!r}, {method!r}")
    hf = model.hf
    why = problem(hf)
    if why:
        raise ValueError(f"context_parallel: {why}")
    mods = attention_modules(hf)
    _register()
    cp = ContextParallel(group, layout, method, _sequence.attention())
    for m in mods:
        m.pyfast_cp = cp
    hf.set_attn_implementation(NAME)
    if hf.config._attn_implementation != NAME:  # transformers only warns: refuse instead
        raise ValueError(f"context_parallel: {type(hf).__name__} does not take an attention "
                         "function from transformers' AttentionInterface (it kept "
                         f"{hf.config._attn_implementation!r})")
    if getattr(model, "_pyfast_positions", None) is None:  # once, however often this is called
        model._pyfast_positions = hf.register_forward_pre_hook(_global_positions, with_kwargs=True)
    hf.pyfast_cp = cp
    return cp


def _global_positions(hf: nn.Module, args, kwargs):
    """Forward pre-hook on the HF model: the shard's global position_ids unless given."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if kwargs.get("position_ids") is None and ids is not None:
        kwargs["position_ids"] = positions(hf.pyfast_cp, ids.shape[-1], ids.device,
                                           learned_limit(hf))
    return args, kwargs


def learned_limit(hf: nn.Module) -> int | None:
    """The size of a learned position table (GPT-2's wpe), None for rotary models."""
    wpe = getattr(getattr(hf, "transformer", None), "wpe", None)
    return wpe.num_embeddings if isinstance(wpe, nn.Embedding) else None


def positions(cp: ContextParallel | None, local_len: int, device,
              limit: int | None = None) -> torch.Tensor:
    """position_ids [1, local_len]: the global positions of this rank's tokens under cp (all
    of them, 0..local_len-1, without); ValueError past a learned table's `limit` positions."""
    world = dist.get_world_size(cp.group) if cp is not None else 1
    if limit is not None and local_len * world > limit:
        raise ValueError(f"sequence of {local_len * world} tokens ({local_len} on each of "
                         f"{world} context-parallel ranks) is longer than the model's {limit} "
                         "learned positions")
    if cp is None:
        return torch.arange(local_len, device=device)[None]
    return sequence_positions(local_len * world, cp.group, cp.layout, device=device)[None]
