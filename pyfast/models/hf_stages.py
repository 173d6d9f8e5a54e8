"""Pipeline stages of a Hugging Face causal LM (HFCausalLM.as_sequential): the same HF modules
as an nn.Sequential [embedding, decoder layer x L, final norm + LM head], which
Pipeline.from_sequential cuts into stages like GPT's.

The stages hold the HF model's own modules (not copies), so the model and its stages are one
set of parameters. What HF's *Model.forward computes between the layers is recomputed where it
is needed, per stage and per call, cheaply: the position ids (0..T-1, or the shard's global
ones under context parallelism), the rotary (cos, sin) tables from a private copy of the
model's rotary module in every layer (non-persistent buffers, a few KB; sharing one would tie
buffers across stages, which Pipeline refuses), and the causal mask by transformers' own
create_causal_mask (None for sdpa and for context-parallel attention, which are causal by
construction). Llama-family models (Llama, Mistral, Qwen2/3: model.embed_tokens, .layers,
.norm, .rotary_emb, lm_head) and GPT-2 (transformer.wte, .wpe, .drop, .h, .ln_f, lm_head).

Names: named_parameters() and state_dict() give the HF model's names ("hf." + HF's own,
HFCausalLM's), so a checkpoint of the stages has the keys of the unsplit model: a pp=2 run
resumes at pp=1 and back, and export maps keys by stripping "hf.". tp_plan() is HFCausalLM's plan resolved to the
stages' module names; after parallelize converts modules in the stages, retie() puts the
converted ones back into the HF model, so both views keep sharing every module.
Tied embeddings (the embedding and the LM head one tensor, on the first and the last stage)
are refused: Pipeline does not all-reduce a gradient across stages.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn

from pyfast._patterns import matches as _matches

from .hf_attention import learned_limit, positions

# config.model_type -> the layout its forward follows. By name, not by attribute names: Gemma
# has model.embed_tokens/layers/norm/rotary_emb too but scales the embeddings by sqrt(hidden),
# which stages built from the attributes alone would silently leave out.
LAYOUT = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
          "gpt2": "gpt2"}


def _mask(config, x: torch.Tensor, pos: torch.Tensor, index: int):
    """Layer `index`'s causal mask, as the HF model's forward picks it: by config.layer_types
    (Qwen2/3 and others), else windowed on every layer when the config has a window
    (Mistral); None where the attention is causal without one (sdpa, pyfast_cp)."""
    from transformers.masking_utils import (create_causal_mask,
                                            create_sliding_window_causal_mask)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        kind = kinds[index]
    else:
        windowed = getattr(config, "sliding_window", None) is not None
        kind = "sliding_attention" if windowed else "full_attention"
    make = create_sliding_window_causal_mask if kind == "sliding_attention" \
        else create_causal_mask
    return make(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                position_ids=pos)


class _Embed(nn.Module):
    """Token embedding (+ learned positions and dropout: GPT-2)."""

    def __init__(self, shared, tok: nn.Module, pos: nn.Module | None = None,
                 drop: nn.Module | None = None):
        super().__init__()
        self.shared, self.tok, self.pos, self.drop = shared, tok, pos, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.pos is not None:
            at = positions(self.shared.cp, ids.shape[-1], ids.device, self.shared.limit)
            x = x + self.pos(at)
        return self.drop(x) if self.drop is not None else x


class _Layer(nn.Module):
    """One HF decoder layer with its positions, rotary tables and mask recomputed."""

    def __init__(self, shared, layer: nn.Module, rotary: nn.Module | None, index: int):
        super().__init__()
        self.shared, self.layer, self.index = shared, layer, index
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = positions(self.shared.cp, x.shape[1], x.device)
        kw = {"position_embeddings": self.rotary(x, pos)} if self.rotary is not None else {}
        out = self.layer(x, attention_mask=_mask(self.shared.config, x, pos, self.index),
                         position_ids=pos, **kw)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def _build(hf: nn.Module, shared) -> tuple[list[nn.Module], list[tuple]]:
    """(the stages' layers, links (stage module, its attribute, HF parent, HF attribute))."""
    kind = LAYOUT.get(getattr(hf.config, "model_type", None))
    if kind is None:
        raise ValueError(f"{type(hf).__name__} (model_type "
                         f"{getattr(hf.config, 'model_type', None)!r}) cannot be cut into "
                         f"pipeline stages: supported model types are {', '.join(LAYOUT)}")
    if kind == "llama":
        base = hf.model
        rotary = getattr(base, "rotary_emb", None)
        layers = [_Embed(shared, base.embed_tokens),
                  *(_Layer(shared, layer, rotary, i) for i, layer in enumerate(base.layers)),
                  _Head(base.norm, hf.lm_head)]
        links = [(layers[0], "tok", base, "embed_tokens"), (layers[-1], "norm", base, "norm")]
        blocks = base.layers
    else:
        base = hf.transformer
        layers = [_Embed(shared, base.wte, base.wpe, base.drop),
                  *(_Layer(shared, block, None, i) for i, block in enumerate(base.h)),
                  _Head(base.ln_f, hf.lm_head)]
        links = [(layers[0], "tok", base, "wte"), (layers[0], "pos", base, "wpe"),
                 (layers[-1], "norm", base, "ln_f")]
        blocks = base.h
    links += [(layers[-1], "lm_head", hf, "lm_head")]
    links += [(layers[1 + i], "layer", blocks, str(i)) for i in range(len(blocks))]
    return layers, links


class HFStages(nn.Sequential):
    """An HFCausalLM as [embedding, decoder layers..., head] (see the module). The model
    contract of pyfast.models (tp_plan, tp_check, retie, vocab_parallel, context_parallel,
    enable_activation_checkpointing) delegates to the HFCausalLM."""

    def __init__(self, owner: nn.Module):
        hf = owner.hf
        head, emb = hf.get_output_embeddings(), hf.get_input_embeddings()
        if head is not None and emb is not None and head.weight is emb.weight:
            raise ValueError(f"{type(hf).__name__} ties its input embedding and LM head "
                             "(tie_word_embeddings): they would live on the first and the last "
                             "pipeline stage, and tied weights across stages are not supported; "
                             "use --pp 1 or an untied model")
        shared = SimpleNamespace(config=hf.config, cp=getattr(hf, "pyfast_cp", None),
                                 limit=learned_limit(hf))
        layers, links = _build(hf, shared)
        super().__init__(*layers)
        object.__setattr__(self, "owner", owner)  # not a submodule: its parameters are ours
        self.shared, self._links, self.config = shared, links, hf.config

    # -- names: the HF model's -----------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """The HF model's names for the same parameters (see the module)."""
        return self.owner.named_parameters(prefix=prefix, recurse=recurse,
                                           remove_duplicate=remove_duplicate)

    def state_dict(self, *args, **kwargs):
        """The HF model's state dict (its keys), the same tensors."""
        return self.owner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.owner.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- the model contract --------------------------------------------------------------------
    @property
    def vocab_parallel(self) -> bool:
        return self.owner.vocab_parallel

    def tp_check(self, tp: int) -> str | None:
        return self.owner.tp_check(tp)

    def tp_plan(self) -> dict:
        """HFCausalLM's plan with each pattern resolved to the stages' names of the modules it
        matches in the HF model (by identity: the stages hold the same modules)."""
        ours = {id(m): n for n, m in self.named_modules(remove_duplicate=False) if n}
        plan = {}
        for pattern, style in self.owner.tp_plan().items():
            hits = [ours[id(m)] for n, m in self.owner.named_modules(remove_duplicate=False)
                    if _matches(pattern, n) and id(m) in ours]
            if not hits:
                raise ValueError(f"tp plan entry {pattern!r} matches no module of the pipeline "
                                 "stages")
            plan.update(dict.fromkeys(hits, style))
        return plan

    def retie(self) -> None:
        """After parallelize (which converted modules in the stages): the HF model takes the
        converted modules back, so the two views share every module again; then its own
        re-tie."""
        for stage, attr, parent, name in self._links:
            m = stage._modules[attr]
            if m is not None and parent._modules[name] is not m:
                parent._modules[name] = m  # setattr, for a ModuleList's "3" too
        self.owner.retie()

    def context_parallel(self, group, layout: str | None = None, method: str = "ring") -> None:
        """HFCausalLM.context_parallel, and the stages' positions follow the layout."""
        self.owner.context_parallel(group, layout=layout, method=method)
        self.shared.cp = self.owner.hf.pyfast_cp

    def cp_check(self) -> str | None:
        return self.owner.cp_check()

    def enable_activation_checkpointing(self, context_fn=None) -> None:
        self.owner.enable_activation_checkpointing(context_fn)
