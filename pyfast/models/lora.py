"""LoRA adapters on pyfast's models, through `peft` (the library users already have).

    model = models.build("hf:DIR" or "gpt-small", ...)
    apply_lora(model, LoraOptions(rank=16, alpha=32, targets="all-linear"))

injects peft's `lora.Linear` into the targeted nn.Linear modules (peft's
`inject_adapter_in_model`: no PeftModel wrapper, so the module tree and every other contract of
pyfast.models stays as it was) and freezes everything else: only `lora_A` / `lora_B` have
requires_grad. A targeted module `x.q_proj` becomes `x.q_proj.base_layer` (the frozen
nn.Linear) + `x.q_proj.lora_A.default` / `lora_B.default`, so parameter names gain
".base_layer" and the adapters' names end in ".lora_A.default.weight" (peft's own naming, which
`pyfast export --to peft` maps to its file format).

Where the model is a Hugging Face one (HFCausalLM), peft works on the inner `transformers`
model (`model.hf`), exactly as `peft.get_peft_model` would; on pyfast's GPT it works on the GPT.
"all-linear" means every nn.Linear of the transformer layers, the LM head excluded (peft's own
meaning of it for HF models; for the GPT: attn.qkv, attn.proj, mlp.fc, mlp.proj).

Initialisation is peft's (A kaiming-uniform from torch's default generator, B zeros), drawn
after the base model, so the same seed gives the same adapters on every rank and mesh.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

ADAPTER = "default"  # peft's adapter name; one adapter per model
GPT_ALL_LINEAR = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")


@dataclass(frozen=True)
class LoraOptions:
    """rank R >= 1; alpha > 0 (the update is scaled by alpha / R; None: 2 R, torchtune's
    and the QLoRA paper's ratio); targets: "all-linear" or module names (peft's matching: a
    name matches a module whose full name is it or ends with "." + it); dropout in [0, 1)."""
    rank: int
    alpha: float | None = None
    targets: str | tuple = "all-linear"
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if self.alpha is None:
            object.__setattr__(self, "alpha", 2.0 * self.rank)
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        t = self.targets
        if isinstance(t, str) and t != "all-linear":
            t = tuple(s.strip() for s in t.split(",") if s.strip())
        if isinstance(t, (list, tuple)):
            t = tuple(t)
            if not t:
                raise ValueError("LoRA targets: no module name given (e.g. q_proj,v_proj, or "
                                 "all-linear)")
        object.__setattr__(self, "targets", t)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def describe(self) -> dict:
        """What a checkpoint records and a resume must match."""
        t = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        return {"rank": self.rank, "alpha": self.alpha, "targets": t, "dropout": self.dropout}


def peft_root(model: nn.Module) -> nn.Module:
    """The module peft injects into: the transformers model of an HFCausalLM, else the model."""
    return getattr(model, "hf", model)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def resolve_targets(model: nn.Module, targets) -> list[str]:
    """The full names (relative to peft_root) of the nn.Linear modules `targets` selects;
    ValueError naming a target that selects none, with the Linear names that exist."""
    root = peft_root(model)
    linear = [n for n, m in root.named_modules() if isinstance(m, nn.Linear)]
    if targets == "all-linear":
        if root is model:  # pyfast's GPT: every block's Linear, not the head
            found = [n for n in linear if any(_matches(n, t) for t in GPT_ALL_LINEAR)]
        else:  # peft's meaning for HF models: every Linear but the output embedding
            out = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
            found = [n for n in linear if root.get_submodule(n) is not out]
        if not found:
            raise ValueError(f"LoRA targets all-linear: {type(root).__name__} has no nn.Linear "
                             "in its layers to adapt")
        return found
    found = []
    for t in targets:
        hit = [n for n in linear if _matches(n, t)]
        if not hit:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ValueError(f"LoRA target {t!r} names no nn.Linear module of "
                             f"{type(root).__name__}; its Linear modules are named "
                             f"{', '.join(leaves)} (or give a longer suffix such as "
                             f"{linear[0] if linear else '-'!r})")
        found += [n for n in hit if n not in found]
    return found


def apply_lora(model: nn.Module, opts: LoraOptions) -> nn.Module:
    """Inject LoRA adapters (peft) into `model` in place and freeze everything else; returns
    the model, with `model.lora` set to `opts`. Works on the meta device (a dry run)."""
    from peft import LoraConfig, inject_adapter_in_model
    if getattr(model, "lora", None) is not None:
        raise ValueError("apply_lora: the model already has LoRA adapters")
    names = resolve_targets(model, opts.targets)
    root = peft_root(model)
    config = LoraConfig(r=opts.rank, lora_alpha=opts.alpha, lora_dropout=opts.dropout,
                        target_modules=names, bias="none")
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(config, root, adapter_name=ADAPTER)
    for n, p in model.named_parameters():  # peft marks its adapters trainable; nothing else
        p.requires_grad_(is_adapter(n))
    model.lora = opts
    model.lora_modules = names
    return model


def is_adapter(name: str) -> bool:
    """Whether a parameter name (any prefix) is a LoRA adapter weight."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the adapters, in registration order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


__all__ = ["ADAPTER", "LoraOptions", "adapter_params", "apply_lora", "is_adapter", "peft_root",
           "resolve_targets"]
