"""Hugging Face causal LMs behind the model contract of pyfast.models (tp_plan, tp_check,
retie, enable_activation_checkpointing, forward(ids) -> logits [B, T, vocab / tp]).

`from_dir(DIR)` (`--model hf:DIR`) builds any supported local model directory: config.json
through `transformers` (ARCHITECTURES: the Llama family and GPT-2), weights from its
*.safetensors when there are any (every key checked against the config's model first), else
the config's own initialiser drawn from torch's default generator. The parameters keep HF's
names under "hf." (the job's checkpoint keys: "hf." + the HF state-dict name; a tied head has
no key of its own, as named_parameters() lists a shared tensor once).

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

import contextlib

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


# model_type -> (TP plan, config fields TP divides, why TP is refused or None). Mistral, Qwen2
# (q/k/v biases: a colwise split shards them too) and Qwen3 (per-head q_norm/k_norm: see
# HFCausalLM.retie) keep Llama's module names.
GPT2_NO_TP = ("GPT-2's attention projection c_attn is one Conv1D with the fused [q; k; v] "
              "columns and a fixed split_size of hidden_size: a column split would hand rank 0 "
              "all of q and half of k. Tensor parallelism is not supported for gpt2; use --dp "
              "or --zero")
ARCHITECTURES = {
    "llama": (LLAMA_TP_PLAN, LLAMA_TP_FIELDS, None),
    "mistral": (LLAMA_TP_PLAN, LLAMA_TP_FIELDS, None),
    "qwen2": (LLAMA_TP_PLAN, LLAMA_TP_FIELDS, None),
    "qwen3": (LLAMA_TP_PLAN, LLAMA_TP_FIELDS, None),
    "gpt2": ({}, (), GPT2_NO_TP),
}


@contextlib.contextmanager
def _unpacked_rows():
    """transformers' mask code reads the position ids back (.item()) to find packed sequences,
    which meta tensors cannot; every row the job feeds is one sequence at positions 0..T-1, for
    which that search answers None (no packing), so answer it without reading."""
    from transformers import masking_utils as mu
    find = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = find


class HFCausalLM(nn.Module):
    """A transformers *ForCausalLM as a pyfast model; `plan` and `fields` say how to split it."""

    def __init__(self, hf: nn.Module, plan: dict, fields: tuple[str, ...],
                 no_tp: str | None = None):
        super().__init__()
        self.hf, self._plan, self._fields, self._no_tp = hf, plan, fields, no_tp
        self.config = hf.config

    def forward(self, ids: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        """The logits; hidden=True: the base model's last hidden state (after its final norm),
        which head_module (lm_head) maps to the logits -- for a loss that runs the head on
        chunks of the tokens."""
        run = (lambda: self.hf.base_model(input_ids=ids).last_hidden_state) if hidden else \
            (lambda: self.hf(input_ids=ids).logits)
        if ids.device.type == "meta":  # a dry run (pyfast.train.dryrun)
            with _unpacked_rows():
                return run()
        return run()

    @property
    def head_module(self) -> nn.Module:
        """The LM head (lm_head, as peft may have wrapped it): forward(ids) ==
        head_module(forward(ids, hidden=True))."""
        return self.hf.get_output_embeddings()

    vocab_parallel = True  # the plan splits embed_tokens and lm_head

    def tp_plan(self, sequence_parallel: bool = False) -> dict:
        if sequence_parallel:  # transformers' attention views q/k/v by its input's [B, T]
            raise ValueError("Hugging Face attention reshapes q, k, v by its input's sequence "
                             "length, which sequence parallelism shards (T / tp); only "
                             "pyfast's GPT (gpt-*) has a sequence-parallel plan")
        return dict(self._plan)

    def tp_check(self, tp: int) -> str | None:
        """Why this model cannot be split over tp ranks, or None."""
        if tp > 1 and self._no_tp:
            return self._no_tp
        for field in self._fields:
            n = getattr(self.config, field)
            if n % tp:
                return f"{type(self.config).__name__}: {field} {n} is not divisible by tp={tp}"
        return None

    def retie(self) -> None:
        """After parallelize the embedding and the head are two converted copies of one table;
        VocabParallelEmbedding and ColumnParallelLinear own the same rows, so share them. Also
        where parallelize leaves per-head norms on local heads (_sum_head_norm_grads)."""
        if self.config.tie_word_embeddings:
            self.hf.lm_head.weight = self.hf.get_input_embeddings().weight
        if not getattr(self, "_norm_hooks", False):  # once: a second hook would sum twice
            self._norm_hooks = self._sum_head_norm_grads()

    def _sum_head_norm_grads(self) -> bool:
        """Qwen3's q_norm/k_norm are one RMSNorm weight [head_dim] applied to every head; under
        TP a rank sees only its heads, so its gradient is a partial sum over them. A hook adds
        the tp ranks' parts (the same all-reduce a row-parallel layer's input gradient needs),
        so the replicated weight gets the dense gradient on every rank and stays replicated.
        Whether the model is split (hooks placed where it has such norms)."""
        for layer in getattr(getattr(self.hf, "model", None), "layers", ()):
            attn = layer.self_attn
            q = attn.q_proj
            if not getattr(q.weight, "tensor_parallel", False):
                return False  # not split: whole heads, whole gradients
            for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.register_hook(_tp_sum(q, f"{type(norm).__name__} gradient"))
        return True

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

    def enable_activation_checkpointing(self, context_fn=None) -> None:
        # transformers 5 renamed gradient_checkpointing_enable (the old name warns there).
        # Non-reentrant, as GPT's blocks: no input needs requires_grad. Unlike GPT, HF's
        # layers recompute only in train() mode, not whenever grad is enabled.
        # context_fn: torch.utils.checkpoint's (the dry run's casts in the recomputation).
        kwargs = {"use_reentrant": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
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


def _tp_sum(layer, what: str):
    """A gradient hook: the sum of the gradient over `layer`'s tp group (failures named
    through the layer's guard, breaking it as its own collectives would)."""
    import torch.distributed as dist

    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        with layer.guard(f"{what} all-reduce"):
            dist.all_reduce(out, group=layer.group)
        return out
    return hook


def read_config(directory: str) -> dict:
    """DIR/config.json as a dict, checked for a supported model_type; ValueError naming the
    directory and the problem (no directory, no config.json, an unsupported architecture)."""
    import json
    import os
    where = f"hf:{directory}"
    if not os.path.isdir(directory):
        raise ValueError(f"{where}: no such directory")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no config.json in it (a Hugging Face model directory, as "
                         "save_pretrained writes it)")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: config.json is not readable JSON: {e}") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in ARCHITECTURES:
        archs = ", ".join(config.get("architectures") or ()) if isinstance(config, dict) else ""
        raise ValueError(f"{where}: model_type {kind!r}{f' ({archs})' if archs else ''} is not "
                         f"supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return config


def vocab_size(directory: str) -> int:
    """The model's embedding rows (config.json's vocab_size)."""
    n = read_config(directory).get("vocab_size")
    if type(n) is not int or n < 1:
        raise ValueError(f"hf:{directory}: config.json's vocab_size is {n!r}, not a positive "
                         "integer")
    return n


def _check_weights(directory: str, model: nn.Module, files: list[str]) -> dict[str, str]:
    """{HF name in the model: name in the files}, after checking the files' keys and shapes
    (headers only: no tensor is read) against the model's state dict; ValueError naming the
    missing, unexpected and mis-shaped keys. A tied head need not be in the files; keys HF
    itself ignores on loading (_keys_to_ignore_on_load_unexpected, e.g. GPT-2's old attn.bias
    masks) are skipped; keys saved without the base model's prefix (the original GPT-2 files:
    "h.0.attn..." for "transformer.h.0.attn...") are matched with it."""
    import re

    from safetensors import safe_open
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = set((getattr(model, "_tied_weights_keys", None) or {})) \
        if model.config.tie_word_embeddings else set()
    have: dict[str, tuple[str, tuple]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                have[key] = (path, tuple(f.get_slice(key).get_shape()))
    prefix = getattr(model, "base_model_prefix", "") + "."
    if prefix != "." and not any(k.startswith(prefix) for k in have):
        have = {(prefix + k if prefix + k in want else k): v for k, v in have.items()}
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                      or ())]
    unexpected = sorted(k for k in have if k not in want and not any(p.search(k) for p in ignore))
    missing = sorted(k for k in want if k not in have and k not in tied)
    shapes = [f"{k} {have[k][1]} in the files, {want[k]} in the model" for k in sorted(have)
              if k in want and have[k][1] != want[k]]
    if unexpected or missing or shapes:
        def some(names):
            return ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
        parts = ([f"missing {len(missing)}: {some(missing)}"] if missing else []) + \
            ([f"unexpected {len(unexpected)}: {some(unexpected)}"] if unexpected else []) + \
            ([f"shapes differ: {some(shapes)}"] if shapes else [])
        raise ValueError(f"hf:{directory}: the *.safetensors weights do not match config.json's "
                         f"{type(model).__name__}: " + "; ".join(parts))
    return {k: have[k][0] for k in want if k in have}


def from_dir(directory: str, seq_len: int, positions: str = "rotary",
             tie_embeddings: bool = False) -> HFCausalLM:
    """The model of a local HF directory (the class its config.json names, in fp32 whatever the
    config's dtype: the job keeps fp32 master weights), with its *.safetensors weights when
    there are any (read unless building on the meta device; their keys are checked either way),
    else initialised by HF from torch's default generator: seed it first. The vocabulary, the
    positions and the tying are the config's: tie_embeddings=True on an untied config and
    learned positions on a rotary one are refused, as is seq_len past GPT-2's learned table."""
    import glob
    import os
    config = read_config(directory)
    kind = config["model_type"]
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise ImportError(_NEEDS.replace("hf-llama-tiny", f"hf:{directory}")) from e
    cfg = AutoConfig.from_pretrained(directory)
    cfg.use_cache = False  # training: no key/value cache
    if tie_embeddings and not cfg.tie_word_embeddings:
        raise ValueError(f"hf:{directory}: --tie-embeddings, but config.json has "
                         "tie_word_embeddings false (the config decides: edit it to tie)")
    if kind == "gpt2":
        if seq_len > cfg.n_positions:
            raise ValueError(f"hf:{directory}: --seq {seq_len} is longer than GPT-2's learned "
                             f"position table (n_positions {cfg.n_positions})")
    elif positions != "rotary":
        raise ValueError(f"hf:{directory}: {kind} has rotary positions only, got "
                         f"positions={positions!r}")
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.get_default_dtype())
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        where = _check_weights(directory, hf, files)
        if next(hf.parameters()).device.type != "meta":
            _load(hf, where)
    plan, fields, no_tp = ARCHITECTURES[kind]
    return HFCausalLM(hf, plan, fields, no_tp)


@torch.no_grad()
def _load(hf: nn.Module, where: dict[str, str]) -> None:
    """Copy each tensor into the model's (cast to its dtype), one file open at a time."""
    from safetensors import safe_open
    by_file: dict[str, list[str]] = {}
    for name, path in where.items():
        by_file.setdefault(path, []).append(name)
    state = hf.state_dict()
    prefix = hf.base_model_prefix + "."
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            stored = set(f.keys())
            for name in names:
                key = name if name in stored else name[len(prefix):]
                # a tied head listed in the files too writes the same rows again
                state[name].copy_(f.get_tensor(key))
