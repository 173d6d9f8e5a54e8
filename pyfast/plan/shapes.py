"""The model shape `pyfast plan` sizes: a preset, a Hugging Face config.json (hf:DIR), or a
parameter count (--params), each with --layers/--hidden/... overriding any field. No torch.

Presets:
- gpt-tiny, gpt-small: pyfast.models.gpt.PRESETS (vocabulary 256, bytes): what the tests and
  the demo train.
- gpt-1b ... gpt-405b: pyfast's reference GPT at the depth and width of published models, heads
  of 128, ffn 4 x hidden, a 32,000-token vocabulary (Llama 1/2's): gpt-1b = GPT-3 XL's 24 x 2048
  (Brown et al. 2020, Table 2.1; 16 heads of 128 instead of 24 of ~85, so tp 2/4/8/16 divide
  them), gpt-7b = GPT-3 6.7B / Llama 2 7B's 32 x 4096, gpt-13b = GPT-3 13B / Llama 2 13B's
  40 x 5120, gpt-70b = Llama 2/3 70B's 80 x 8192, gpt-405b = Llama 3.1 405B's 126 x 16384.
  `pyfast train --model gpt:layers=...,heads=...,hidden=...` builds them.
- llama-1b ... llama-405b (llama-8b: Llama 3.1 8B; llama-70b: Llama 3 70B, llama-2-70b:
  Llama 2 70B): the published models' config.json values (below); `pyfast train` builds them
  only from a local Hugging Face directory (--model hf:DIR): a full plan prints no command, a
  LoRA plan's names hf:DIR after the repository (HF_REPOS).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace

from .spec import ModelShape


def _gpt(layers, heads, hidden, vocab=32000):
    return dict(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden,
                vocab=vocab, arch="gpt")


def _llama(layers, hidden, heads, kv_heads, ffn, vocab, tied=False):
    return dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                vocab=vocab, arch="llama", tied=tied)


PRESETS = {
    "gpt-tiny": _gpt(2, 4, 64, vocab=256),
    "gpt-small": _gpt(6, 8, 384, vocab=256),
    "gpt-1b": _gpt(24, 16, 2048),
    "gpt-7b": _gpt(32, 32, 4096),
    "gpt-13b": _gpt(40, 40, 5120),
    "gpt-70b": _gpt(80, 64, 8192),
    "gpt-405b": _gpt(126, 128, 16384),
    # config.json of each (num_hidden_layers, hidden_size, num_attention_heads,
    # num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings):
    # meta-llama/Llama-3.2-1B: 16, 2048, 32, 8, 8192, 128256, true
    "llama-1b": _llama(16, 2048, 32, 8, 8192, 128256, tied=True),
    # meta-llama/Llama-2-7b-hf: 32, 4096, 32, 32, 11008, 32000, false
    "llama-7b": _llama(32, 4096, 32, 32, 11008, 32000),
    # meta-llama/Llama-3.1-8B: 32, 4096, 32, 8, 14336, 128256, false
    "llama-8b": _llama(32, 4096, 32, 8, 14336, 128256),
    # meta-llama/Llama-2-13b-hf: 40, 5120, 40, 40, 13824, 32000, false
    "llama-13b": _llama(40, 5120, 40, 40, 13824, 32000),
    # meta-llama/Meta-Llama-3-70B: 80, 8192, 64, 8, 28672, 128256, false
    "llama-70b": _llama(80, 8192, 64, 8, 28672, 128256),
    # meta-llama/Llama-2-70b-hf: 80, 8192, 64, 8, 28672, 32000, false
    "llama-2-70b": _llama(80, 8192, 64, 8, 28672, 32000),
    # meta-llama/Llama-3.1-405B: 126, 16384, 128, 8, 53248, 128256, false
    "llama-405b": _llama(126, 16384, 128, 8, 53248, 128256),
}

# the Hugging Face repository of each llama preset: `pyfast train --model hf:DIR` runs a local
# copy of it (a LoRA plan's command names DIR after the repository)
HF_REPOS = {"llama-1b": "meta-llama/Llama-3.2-1B", "llama-7b": "meta-llama/Llama-2-7b-hf",
            "llama-8b": "meta-llama/Llama-3.1-8B", "llama-13b": "meta-llama/Llama-2-13b-hf",
            "llama-70b": "meta-llama/Meta-Llama-3-70B",
            "llama-2-70b": "meta-llama/Llama-2-70b-hf",
            "llama-405b": "meta-llama/Llama-3.1-405B"}

OVERRIDES = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
# the reference GPT presets the --params rule interpolates depth between (gpt-1b .. gpt-405b)
RULE_PRESETS = ("gpt-1b", "gpt-7b", "gpt-13b", "gpt-70b", "gpt-405b")
PARAMS_RULE = ("--params N: pyfast's reference GPT with its depth interpolated (log-log in the "
               "parameter count) between the gpt-1b..gpt-405b presets, the width for it (a "
               "multiple of 1024 from 4096 up, of 128 below; heads of 128, of 64 below 1024) "
               "and the depth re-solved for that width (of the two widths either side, the one "
               "keeping the depth within a quarter, then nearest N); vocabulary 32000, ffn 4 x "
               "hidden")


def preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is unknown; known: {', '.join(PRESETS)}, hf:DIR "
                         "(a Hugging Face config.json), or --params N")
    return ModelShape(**PRESETS[name], name=name)


def _key(cfg: dict, path: str, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is not None:
        return default
    raise ValueError(f"{path}: no {' or '.join(repr(n) for n in names)} (a llama/mistral/qwen2 "
                     "config.json has num_hidden_layers, hidden_size, num_attention_heads, "
                     "intermediate_size, vocab_size; a gpt2 one n_layer, n_embd, n_head)")


def from_hf(directory: str) -> ModelShape:
    """The shape of a Hugging Face model from DIR/config.json: llama/mistral/qwen2-style keys
    (SwiGLU: arch "llama") or gpt2's n_layer/n_embd/n_head (arch "gpt")."""
    if not os.path.isdir(directory):
        raise ValueError(f"--model hf:{directory}: no such directory")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model hf:{directory}: no config.json in it")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    gpt2 = cfg.get("model_type") == "gpt2" or "n_embd" in cfg
    layers = _key(cfg, path, "num_hidden_layers", "n_layer")
    hidden = _key(cfg, path, "hidden_size", "n_embd")
    heads = _key(cfg, path, "num_attention_heads", "n_head")
    kv = _key(cfg, path, "num_key_value_heads", default=heads)
    ffn = _key(cfg, path, "n_inner", default=4 * hidden) if gpt2 else \
        _key(cfg, path, "intermediate_size")
    vocab = _key(cfg, path, "vocab_size")
    # transformers' default: GPT-2 ties its head to the embedding; Llama/Mistral/Qwen2 do not
    tied = bool(cfg.get("tie_word_embeddings", gpt2))
    for k, v in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv_heads", kv),
                 ("ffn", ffn), ("vocab", vocab)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{path}: {k} must be an integer, got {v!r}")
    return ModelShape(layers, hidden, heads, kv, ffn, vocab, arch="gpt" if gpt2 else "llama",
                      tied=tied, name=f"hf:{directory} ({cfg.get('model_type', '?')})")


def _depth(n: float) -> int:
    """Layers for n parameters: log-log interpolation between the RULE_PRESETS (the end
    segments extended), at least 2."""
    pts = [(math.log(preset(p).params()), math.log(preset(p).layers)) for p in RULE_PRESETS]
    x = math.log(n)
    i = min(max(sum(1 for px, _ in pts if px <= x) - 1, 0), len(pts) - 2)
    (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    return max(2, round(math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))))


def from_params(n: float, layers: int | None = None, hidden: int | None = None,
                vocab: int | None = None) -> ModelShape:
    """The reference GPT of about n parameters (PARAMS_RULE); given fields are kept."""
    if not n >= 1e4:
        raise ValueError(f"--params {n:g}: expected a parameter count of at least 1e4, e.g. 70e9")
    vocab = vocab or 32000
    depth = layers or _depth(n)

    def shape(h, L):
        hd = 128 if h >= 1024 else 64
        return ModelShape(**_gpt(L, max(1, h // hd), h, vocab), name=f"--params {n:g}")
    if hidden is not None:
        return shape(hidden, depth)
    # 12 L h^2 + 2 V h ~ n at the interpolated depth: the root, rounded to a multiple of 1024
    # from 4096 up (heads a multiple of 8: tp 2/4/8 divide them), of 128 below; then (depth
    # not given) the depth re-solved for that width: of the widths either side, the one whose
    # depth stays nearest the interpolated one, then the exact count nearest n
    h = (-2 * vocab + math.sqrt(4 * vocab ** 2 + 48 * depth * n)) / (24 * depth)
    g = 1024 if h >= 4096 else 128
    cands = []
    for w in {max(128, int(h) // g * g), max(128, int(h) // g * g + g)}:
        per = shape(w, 1).layer_params()
        L = layers or max(2, round((n - shape(w, 1).params() + per) / per))
        cands.append(shape(w, L))
    return min(cands, key=lambda s: (abs(math.log(s.layers / depth)) > 0.25,
                                     abs(s.params() - n)))


def resolve(model: str | None, params: float | None, **over) -> ModelShape:
    """The shape from --model or --params, with the --layers/--hidden/... given in `over`
    (None: not given) replacing its fields; ValueError naming the problem."""
    over = {k: v for k, v in over.items() if v is not None}
    bad = set(over) - set(OVERRIDES)
    if bad:
        raise ValueError(f"unknown shape fields {sorted(bad)}")
    if (model is None) == (params is None):
        raise ValueError("give the model as --model PRESET|hf:DIR or as --params N (one of them)")
    if params is not None:
        base = from_params(params, over.get("layers"), over.get("hidden"), over.get("vocab"))
    elif model.startswith("hf:"):
        base = from_hf(model[3:])
    else:
        base = preset(model)
    if not over:
        return base
    if "heads" in over and "kv_heads" not in over and base.kv_heads == base.heads:
        over["kv_heads"] = over["heads"]  # multi-head attention stays multi-head
    if "hidden" in over and "ffn" not in over and base.arch == "gpt" and \
            base.ffn % base.hidden == 0:
        over["ffn"] = base.ffn // base.hidden * over["hidden"]  # keep the MLP ratio
    name = base.name + " (" + ", ".join(f"{k}={v}" for k, v in over.items()) + ")"
    return replace(base, **over, name=name)
