"""Models the main job trains, by name: build(name, ...) -> an nn.Module with

    tp_plan() -> dict            parallelize()'s plan (the LM head's logits stay vocab-sharded)
    tp_check(tp) -> str | None   why the model cannot be split over tp ranks
    retie()                      re-tie shared weights after parallelize (no-op if untied)
    enable_activation_checkpointing()
    vocab_parallel -> bool       whether the plan splits the vocabulary over tp
    forward(ids [B, T]) -> logits [B, T, vocab / tp if vocab_parallel else vocab]
    forward(ids, hidden=True) -> the hidden states [B, T, D] that the LM head reads
    head_module                  the module that maps those hidden states to the logits
                                 (so a loss can run the head on chunks of the tokens)

and, if it can be cut into pipeline stages, is an nn.Sequential (`pipelinable(model)`).
A registry is a dict: a new model is one entry.
"""
from __future__ import annotations

from torch import nn

from .gpt import GPT, PRESETS, GPTConfig


def _gpt(preset: str):
    def build(vocab_size: int, seq_len: int, positions: str = "rotary",
              tie_embeddings: bool = False) -> GPT:
        return GPT(GPTConfig(**PRESETS[preset], seq_len=seq_len, vocab_size=vocab_size,
                             positions=positions, tie_embeddings=tie_embeddings))
    return build


def _hf_llama_tiny(vocab_size: int, seq_len: int, positions: str = "rotary",
                   tie_embeddings: bool = False):
    from .hf import llama_tiny  # transformers is optional: imported only when asked for
    return llama_tiny(vocab_size, seq_len, positions=positions, tie_embeddings=tie_embeddings)


MODELS = {"gpt-tiny": _gpt("gpt-tiny"), "gpt-small": _gpt("gpt-small"),
          "hf-llama-tiny": _hf_llama_tiny}


# `gpt:layers=L,heads=H,hidden=D[,mlp=R]`: the reference GPT at any shape (the planner's
# validation dry-runs 7B-shaped ones; a preset name is kept for what the tests and demo train)
SHAPE_KEYS = {"layers": "n_layer", "heads": "n_head", "hidden": "d_model", "mlp": "mlp_ratio"}


def gpt_shape(name: str) -> dict:
    """GPTConfig fields of a `gpt:layers=L,heads=H,hidden=D[,mlp=R]` name; ValueError naming
    what is wrong."""
    fields = {}
    for part in name[len("gpt:"):].split(","):
        key, _, value = part.partition("=")
        if key.strip() not in SHAPE_KEYS or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"{name!r}: expected gpt:layers=L,heads=H,hidden=D[,mlp=R] with "
                             f"positive integers, got {part!r}")
        fields[SHAPE_KEYS[key.strip()]] = int(value)
    missing = {"n_layer", "n_head", "d_model"} - set(fields)
    if missing:
        names = [k for k, v in SHAPE_KEYS.items() if v in missing]
        raise ValueError(f"{name!r}: missing {', '.join(names)}")
    return fields


def known(name: str) -> bool:
    return name in MODELS or name.startswith(("gpt:", "hf:"))


def build(name: str, vocab_size: int, seq_len: int, **options) -> nn.Module:
    """The full model, initialised from torch's default generator (seed it first).
    `hf:DIR`: a local Hugging Face model directory (pyfast.models.hf.from_dir), with its own
    vocabulary (config.json's vocab_size; `vocab_size` is ignored: the job checks the data's
    fits) and its weights when it has any."""
    if name.startswith("hf:"):
        from .hf import from_dir  # transformers is optional: imported only when asked for
        return from_dir(name[len("hf:"):], seq_len, **options)
    if name.startswith("gpt:"):
        return GPT(GPTConfig(**gpt_shape(name), seq_len=seq_len, vocab_size=vocab_size,
                             **options))
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}, "
                         "gpt:layers=L,heads=H,hidden=D, hf:DIR")
    return MODELS[name](vocab_size, seq_len, **options)


def pipelinable(model: nn.Module) -> bool:
    return isinstance(model, nn.Sequential)


__all__ = ["GPT", "GPTConfig", "MODELS", "PRESETS", "build", "gpt_shape", "known", "pipelinable"]
