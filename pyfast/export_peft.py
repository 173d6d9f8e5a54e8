"""A LoRA run's adapters out of pyfast (docs/finetune.md, docs/FORMATS.md "PEFT adapter").

- `--to peft`: adapter_model.safetensors + adapter_config.json, peft's save_pretrained format,
  for `PeftModel.from_pretrained(base, OUT)`. For hf: and hf-llama-tiny runs the tensors come
  from peft's own get_peft_model_state_dict on the rebuilt model (the key prefix
  "base_model.model." is the PeftModel's, which save_pretrained is called on); the config is a
  peft LoraConfig saved by peft. For pyfast GPT runs the adapters follow the base through
  export.gpt_to_hf: qkv -> GPT-2's c_attn (a Conv1D: fan_in_fan_out) or NeoX's
  query_key_value, B's rows reordered exactly as the base's fused rows are (the update B A is
  row-permuted like W, so A is unchanged); proj/fc/proj -> their HF names, unchanged.
- `--to hf --merge`: W + (alpha / r) B A written into the full-precision base (peft's merge,
  safe_merge: NaN refused). A run whose base is held below fp32 (--base-dtype bf16/int8/nf4)
  merges into the base rebuilt from --model and --seed (or hf:DIR's weights), never into its
  dequantized copy: that adds the quantization error to every merged weight, and quantizing
  the merged weight again would move it further (peft#2321). The rebuilt base is checked
  against the run's: it must quantize to the very codes the run trained on.
- `--to hf --base`: the run's full-precision base as its job built it (seeded, no adapters):
  what the adapters of an hf-llama-tiny or GPT run load onto.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from pyfast.models.lora import ADAPTER, peft_root
from pyfast.train.config import ConfigError, TrainConfig, build_model

FILES = ("adapter_model.safetensors", "adapter_config.json")
# pyfast GPT's adapted modules -> the module of export.gpt_to_hf's model, by positions
GPT2_NAMES = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
              "mlp.proj": "mlp.c_proj"}
NEOX_NAMES = {"attn.qkv": "attention.query_key_value", "attn.proj": "attention.dense",
              "mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h"}


def _error(msg: str):
    from pyfast.export import ExportError
    return ExportError(msg)


def lora_of(model, cfg: TrainConfig, path) -> nn.Module:
    """`model` if it carries LoRA adapters, each whole and finite; ExportError naming the
    adapter (or why the run has none) otherwise."""
    if not cfg.lora:
        raise _error(f"{path}: the run was trained without --lora: it has no adapters to "
                     "export (export the whole model with --to hf)")
    if getattr(model, "lora", None) is None:
        raise _error(f"{path}: --model {cfg.model} with --pp {cfg.pp}: the pipeline's stage "
                     "form of a LoRA model is not exported yet (train it with --pp 1)")
    root, r = peft_root(model), model.lora.rank
    for name in model.lora_modules:
        m = root.get_submodule(name)
        base = m.get_base_layer()
        want = {"lora_A": (r, base.in_features), "lora_B": (base.out_features, r)}
        for part, shape in want.items():
            d = getattr(m, part, {})
            w = d[ADAPTER].weight if ADAPTER in d else None
            what = f"adapter {name}.{part} of {path}"
            if w is None or w.numel() == 0:
                raise _error(f"{what} is missing or empty")
            if tuple(w.shape) != shape:
                raise _error(f"{what} has shape {tuple(w.shape)}, expected {shape}")
            if not torch.isfinite(w).all():
                raise _error(f"{what} holds NaN or Inf (the run diverged at or before this "
                             "step: export an earlier --step)")
    return model


# ---------------------------------------------------------------- --to peft
def _short_targets(names: list[str], every: list[str]) -> list[str]:
    """The leaf names (q_proj, ...) when they select exactly `names` among `every` module name
    (peft's suffix match), else the full names: a config a user can read and edit."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    hit = {n for n in every if n.rsplit(".", 1)[-1] in leaves}
    return leaves if hit == set(names) else sorted(names)


def _hf_modules(root: nn.Module) -> list[str]:
    return [n for n, _ in root.named_modules()
            if ".lora_" not in n and not n.endswith("base_layer") and ".base_layer." not in n]


def _gpt_adapters(model) -> tuple[dict, list[str], list[str], bool]:
    """(peft-format tensors, target module names, every block module name, fan_in_fan_out) of
    a pyfast GPT's adapters, named and ordered as export.gpt_to_hf names and orders its base."""
    from pyfast.export import _halves, _qkv_major
    c = model.cfg
    gpt2 = c.positions == "learned"
    table, top = (GPT2_NAMES, "transformer.h") if gpt2 else (NEOX_NAMES, "gpt_neox.layers")
    tensors, targets, every = {}, [], []
    for i in range(c.n_layer):
        every += [f"{top}.{i}.{v}" for v in table.values()]
    for name in model.lora_modules:  # "3.attn.qkv": block 3 is layer 2
        block, _, local = name.partition(".")
        hf = f"{top}.{int(block) - 1}.{table[local]}"
        m = model.get_submodule(name)
        a = m.lora_A[ADAPTER].weight.detach()
        b = m.lora_B[ADAPTER].weight.detach()
        if local == "attn.qkv":
            b = _qkv_major(b, c.n_head) if gpt2 else _halves(b, c.n_head)
        tensors[f"base_model.model.{hf}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{hf}.lora_B.weight"] = b.contiguous()
        targets.append(hf)
    return tensors, targets, every, gpt2


def base_name(cfg: TrainConfig) -> str | None:
    """What adapter_config.json names as the base: hf:DIR's directory (absolute when it
    exists here); None for a base that only `pyfast export --to hf --base` writes out."""
    if not cfg.model.startswith("hf:"):
        return None
    d = Path(cfg.model[3:])
    return str(d.resolve()) if d.is_dir() else str(d)


def write_peft(model, cfg: TrainConfig, path, out: Path) -> str:
    """Write `model`'s adapters to directory `out` in peft's format; returns what was written."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    from pyfast.models import GPT
    lora_of(model, cfg, path)
    o = model.lora
    if isinstance(model, GPT):
        tensors, names, every, fan = _gpt_adapters(model)
    else:  # peft's own state dict of the injected transformers model
        root = peft_root(model)
        sd = get_peft_model_state_dict(root, adapter_name=ADAPTER, save_embedding_layers=False)
        tensors = {f"base_model.model.{k}": v.detach().contiguous() for k, v in sd.items()}
        names, every, fan = list(model.lora_modules), _hf_modules(root), False
    if len(tensors) != 2 * len(names):
        raise _error(f"{path}: {len(tensors)} adapter tensors for {len(names)} adapted modules")
    config = LoraConfig(r=o.rank, lora_alpha=o.alpha, lora_dropout=o.dropout,
                        target_modules=_short_targets(names, every), bias="none",
                        fan_in_fan_out=fan, task_type="CAUSAL_LM",
                        base_model_name_or_path=base_name(cfg), inference_mode=True)
    save_file({k: v.to(torch.float32) for k, v in tensors.items()},
              str(out / FILES[0]), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    conf_file = out / FILES[1]  # peft writes target_modules from a set: sorted, the file is stable
    c = json.loads(conf_file.read_text())
    if isinstance(c.get("target_modules"), list):
        c["target_modules"] = sorted(c["target_modules"])
        conf_file.write_text(json.dumps(c, indent=2, sort_keys=True))  # peft's own layout
    return f"PEFT LoRA adapter: r {o.rank}, alpha {o.alpha:g}, {len(names)} modules"


# ---------------------------------------------------------------- the full-precision base
def base_model(cfg: TrainConfig, vocab_size: int, lora: bool = False) -> nn.Module:
    """The run's model as its job built it before step 1 (torch.manual_seed(--seed), then
    build_model), its base in full precision; with the (initial) adapters if `lora`."""
    flat = dataclasses.replace(cfg, base_dtype="none", pp=1, lora=cfg.lora if lora else 0)
    torch.manual_seed(cfg.seed)
    try:
        return build_model(flat, vocab_size).eval()
    except ConfigError as e:
        raise _error(f"cannot rebuild the run's base (--model {cfg.model}): {e}") from None


def _same_base(run: nn.Module, full: nn.Module, cfg: TrainConfig, path) -> None:
    """ExportError unless `full`'s base (rebuilt) is the one `run` (a reduced-base run at
    `path`) trained on: each adapted weight quantizes to the run's codes, the rest equal once
    cast to the run's dtype."""
    from pyfast.models.lora import is_adapter
    from pyfast.models.quant_base import QuantLinear, quantize_weight
    why = (f"the base rebuilt from --model {cfg.model} --seed {cfg.seed} is not the one the "
           f"run at {path} trained on")
    got = dict(full.named_parameters())
    for name, m in run.named_modules():
        if isinstance(m, QuantLinear):
            w = full.get_submodule(name).weight.detach()
            codes, scales = quantize_weight(w, m.fmt, m.block)
            if not (torch.equal(codes, m.codes) and torch.allclose(scales, m.scales)):
                raise _error(f"{why}: {name} quantizes to other {m.fmt} codes (hf:DIR changed "
                             "since the run?)")
    for n, p in run.named_parameters():
        if is_adapter(n) or n.endswith((".codes", ".scales")):
            continue
        if n not in got or not torch.equal(got[n].detach().to(p.dtype), p.detach()):
            raise _error(f"{why}: {n} differs")


def _reduced(model) -> bool:
    """Whether the model's frozen base is held below fp32 (--base-dtype, or frozen tensors the
    job keeps in bf16): then the checkpoint is not the full-precision base to merge into."""
    from pyfast.models.quant_base import QuantLinear
    return any(isinstance(m, QuantLinear) for m in model.modules()) or \
        any(p.dtype != torch.float32 for p in model.parameters())


def merged(model, cfg: TrainConfig, meta: dict, path) -> nn.Module:
    """The run's model with W + scaling B A merged into its full-precision base and the
    adapters removed: a plain pyfast model for export.to_hf."""
    from peft.tuners.lora import LoraLayer
    lora_of(model, cfg, path)
    if _reduced(model):  # merge into the rebuilt full-precision base, never the codes
        full = base_model(cfg, meta["vocab_size"], lora=True)
        _same_base(model, full, cfg, path)
        mine = dict(model.named_parameters())
        with torch.no_grad():
            for n, p in full.named_parameters():
                if ".lora_" in n:
                    p.copy_(mine[n])
        model = full
    root = peft_root(model)
    with torch.no_grad():
        for name, m in list(root.named_modules()):
            if isinstance(m, LoraLayer):
                m.merge(safe_merge=True, adapter_names=[ADAPTER])
                parent, _, leaf = name.rpartition(".")
                setattr(root.get_submodule(parent), leaf, m.get_base_layer())
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in root.__dict__:
            delattr(root, attr)
    model.lora, model.lora_modules = None, []
    return model.eval()


def describe(out: Path) -> str:
    c = json.loads((out / FILES[1]).read_text())
    return f"adapter_config.json: target_modules {c['target_modules']}, base " \
           f"{c.get('base_model_name_or_path') or '(pyfast export RUN --to hf BASE --base)'}"
