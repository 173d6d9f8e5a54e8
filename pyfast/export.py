"""`pyfast export RUN_DIR [--step N] --to hf OUT_DIR`: a training run's checkpoint as a Hugging
Face `save_pretrained` directory (model.safetensors, config.json, generation_config.json, and
the tokenizer when the data had one), loadable with AutoModelForCausalLM.from_pretrained.
A LoRA run (--lora): `--to peft` writes its adapters in peft's format, `--to hf --merge` the
adapters merged into the full-precision base, `--to hf --base` that base (pyfast.export_peft).

Consolidation reuses the one-process resume path, whatever mesh and ZeRO stage wrote the
checkpoint: the model is built whole on one process (a 1-rank gloo group) and DCP reshards into
it (tp DTensors and pipeline stages are saved under the full model's names); a ZeRO checkpoint
(flat shards by FQN) loads through pyfast.parallel.zero.checkpoint at world 1.

What maps to what (the same math, checked by logits in tests/test_export.py):
- pyfast GPT, learned positions -> GPT2LMHeadModel: Conv1D weights are Linear's transposed,
  activation "gelu" (erf, as F.gelu; GPT-2's default gelu_new is the tanh approximation),
  attention scaled by 1/sqrt(head_dim), LayerNorm eps as the model's, biases everywhere but
  the LM head; the fused QKV rows go from [head, (q,k,v), head_dim] (Megatron's) to GPT-2's
  [(q,k,v), head, head_dim].
- pyfast GPT, rotary positions -> GPTNeoXForCausalLM with use_parallel_residual=False (x +
  attn(ln1 x), then + mlp(ln2 x): pyfast's block), partial_rotary_factor 1, rope_theta =
  rope_base, attention_bias. NeoX's fused QKV already has Megatron's row order; its rotary
  rotates the halves (i, i + hd/2) where pyfast rotates (2i, 2i+1) pairs with the same
  frequency inv[i], so q's and k's rows in each head are permuted evens-then-odds (q.k is
  unchanged by one permutation applied to both). GPT-J rotates pairs as pyfast does but runs
  attention and MLP in parallel and has no QKV bias, so it would not be the same model.
- `hf:` models and hf-llama-tiny: their own architecture and config, the checkpoint's "hf."
  prefix dropped (save_pretrained of the wrapped transformers model).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from pyfast.errors import ExportError  # export_peft raises it too
from pyfast.tokens import tokenizer_file
from pyfast.train import checkpoint as ck
from pyfast.train.config import ConfigError, TrainConfig, build_model

from .export_peft import _halves, _qkv_major  # the GPT -> HF row maps, shared with adapters

FORMATS = ("hf", "peft")


def pick(run, step: int | None = None) -> tuple[int, Path]:
    """(step, path) of the checkpoint to export: `step`'s, or the latest complete one."""
    run = Path(run)
    if not run.is_dir():
        raise ExportError(f"{run}: not a directory (expected a run directory of pyfast train)")
    if not ck.root(run).is_dir():
        raise ExportError(f"{run}: not a run directory of pyfast train (no checkpoints/ in it)")
    skipped = []
    found = ck.complete(run, warn=skipped.append)
    if not found:
        why = ("; " + "; ".join(skipped)) if skipped else ""
        raise ExportError(f"{run}: no complete checkpoint under {ck.root(run)}{why}")
    if step is None:
        return found[-1]
    for s, path in found:
        if s == step:
            return s, path
    raise ExportError(f"{run}: no complete checkpoint at step {step}; available steps: "
                      f"{', '.join(str(s) for s, _ in found)}")


def run_config(meta: dict, path) -> TrainConfig:
    """The run's recorded flags (fields this version does not know are left out)."""
    if "config" not in meta:
        raise ExportError(f"{path}: the checkpoint does not record its run's flags (written by "
                          "an older pyfast): cannot rebuild its model")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in meta["config"].items() if k in known})


@contextlib.contextmanager
def _one_process():
    """A 1-rank gloo world (DCP and zero() want a process group), unless one exists."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ExportError("export runs on one process: call it outside a distributed job")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def load_model(path) -> tuple[TrainConfig, dict, torch.nn.Module]:
    """(the run's flags, the checkpoint's meta.json, the whole pyfast model with its weights at
    that step) on one process, from checkpoint directory `path` of any mesh and ZeRO stage."""
    path = Path(path)
    meta = ck.read_meta(path)
    cfg = run_config(meta, path)
    torch.manual_seed(cfg.seed)  # as the job: a LoRA run's frozen base is rebuilt, not loaded
    try:
        model = build_model(cfg, meta["vocab_size"])
    except ConfigError as e:
        raise ExportError(f"{path}: cannot rebuild the run's model: {e}") from None
    with _one_process():
        # tied weights once, under their first name; a LoRA run's checkpoint holds the
        # adapters only (its base is --model's at --seed: pyfast.train.job.Job.state)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if meta.get("zero", 0):
            _load_zero(path, cfg, model, params)
        else:  # DCP reshards tp DTensors and pipeline stages into the whole tensors
            try:
                ck.load({"model": {n: p.detach() for n, p in params.items()}}, path)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 (a key, a shard)
                raise ExportError(f"{path}: the checkpoint does not hold the run's whole model "
                                  f"(a tensor or a shard file missing?): {_first(e)}"
                                  f"{_in_missing_files(path)}") from None
    model.eval()
    return cfg, meta, model


def _first(e: Exception) -> str:
    """DCP's message, cut to what names the problem (it wraps rank tracebacks)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    keys = [ln for ln in lines if "key" in ln.lower() or "No such file" in ln]
    return (keys or lines or [type(e).__name__])[-1][:400]


def _in_missing_files(path: Path) -> str:
    """'; FILE held NAME, ...' for DCP shard files that DCP's metadata lists but are gone."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        sd = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception:  # noqa: BLE001 (an unreadable .metadata: DCP's message says enough)
        return ""
    gone = {}
    for idx, info in sd.items():
        if not (path / info.relative_path).is_file():
            gone.setdefault(info.relative_path, []).append(idx.fqn.removeprefix("model."))

    def order(n):  # a LoRA run's adapters first: what the user is after
        return (".lora_" not in n, n)
    return "".join(f"; {f} held {', '.join(sorted(set(n), key=order)[:4])}"
                   f"{' and more' if len(set(n)) > 4 else ''}" for f, n in sorted(gone.items()))


def _load_zero(path: Path, cfg: TrainConfig, model, params: dict) -> None:
    """A ZeRO checkpoint (flat shards by FQN) through zero's own loader at world 1, stage 1
    (any stage loads any: pyfast.parallel.zero.checkpoint), into a copy of the model; then the
    whole tensors into `model`. The parameter groups are the job's (decay: 2-D and up)."""
    import copy

    from pyfast.parallel.zero import checkpoint as zck
    from pyfast.parallel.zero import zero
    work = copy.deepcopy(model)
    ps = [p for p in work.parameters() if p.requires_grad]  # a LoRA run: the adapters
    groups = [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
    z, opt = zero(work, torch.optim.AdamW, stage=1, params=groups, lr=cfg.lr)
    try:
        zck.load(str(path), z, opt)
        full = zck.full_state_dict(z, opt)["model"]
    finally:
        z.close()
    missing = sorted(set(params) - set(full))
    if missing:
        raise ExportError(f"{path}: the ZeRO checkpoint has no {', '.join(missing[:5])}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(full[n])


# ---------------------------------------------------------------- pyfast GPT -> transformers
def _tokens(tok: dict | None) -> dict:
    eos = tok["eos_id"] if tok else None
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None}


def gpt_to_hf(model, tok: dict | None = None):
    """A transformers model with the same math as pyfast GPT `model` (module docstring)."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM
    c, L = model.cfg, model.cfg.n_layer
    eps = {m.eps for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
    if len(eps) != 1:
        raise ExportError(f"GPT with LayerNorm eps {sorted(eps)}: one value expected")
    eps = eps.pop()
    sd = {n: p.detach() for n, p in model.state_dict().items()}
    out = {}
    if c.positions == "learned":
        hf_cfg = GPT2Config(vocab_size=c.vocab_size, n_positions=c.seq_len, n_embd=c.d_model,
                            n_layer=L, n_head=c.n_head, n_inner=c.mlp_ratio * c.d_model,
                            activation_function="gelu", layer_norm_epsilon=eps,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                            reorder_and_upcast_attn=False,
                            tie_word_embeddings=c.tie_embeddings, use_cache=True, **_tokens(tok))
        hf = GPT2LMHeadModel(hf_cfg)
        out["transformer.wte.weight"] = sd["0.tok.weight"]
        out["transformer.wpe.weight"] = sd["0.pos.weight"]
        for i in range(L):
            p, q = f"{i + 1}.", f"transformer.h.{i}."
            for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[q + b + ".weight"], out[q + b + ".bias"] = sd[p + a + ".weight"], \
                    sd[p + a + ".bias"]
            out[q + "attn.c_attn.weight"] = _qkv_major(sd[p + "attn.qkv.weight"], c.n_head).t()
            out[q + "attn.c_attn.bias"] = _qkv_major(sd[p + "attn.qkv.bias"], c.n_head)
            for a, b in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                         ("mlp.proj", "mlp.c_proj")):  # Conv1D: [in, out]
                out[q + b + ".weight"] = sd[p + a + ".weight"].t()
                out[q + b + ".bias"] = sd[p + a + ".bias"]
        head, base = f"{L + 1}.", "transformer.ln_f"
    else:
        hf_cfg = GPTNeoXConfig(vocab_size=c.vocab_size, hidden_size=c.d_model,
                               num_hidden_layers=L, num_attention_heads=c.n_head,
                               intermediate_size=c.mlp_ratio * c.d_model, hidden_act="gelu",
                               max_position_embeddings=c.seq_len, layer_norm_eps=eps,
                               use_parallel_residual=False, attention_bias=True,
                               attention_dropout=0.0, hidden_dropout=0.0,
                               rope_parameters={"rope_type": "default",
                                                "rope_theta": float(c.rope_base),
                                                "partial_rotary_factor": 1.0},
                               tie_word_embeddings=c.tie_embeddings, use_cache=True,
                               **_tokens(tok))
        hf = GPTNeoXForCausalLM(hf_cfg)
        out["gpt_neox.embed_in.weight"] = sd["0.tok.weight"]
        for i in range(L):
            p, q = f"{i + 1}.", f"gpt_neox.layers.{i}."
            for a, b in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"),
                         ("attn.proj", "attention.dense"), ("mlp.fc", "mlp.dense_h_to_4h"),
                         ("mlp.proj", "mlp.dense_4h_to_h")):
                out[q + b + ".weight"], out[q + b + ".bias"] = sd[p + a + ".weight"], \
                    sd[p + a + ".bias"]
            for s in ("weight", "bias"):
                out[q + "attention.query_key_value." + s] = _halves(sd[p + "attn.qkv." + s],
                                                                    c.n_head)
        head, base = f"{L + 1}.", "gpt_neox.final_layer_norm"
    out[base + ".weight"], out[base + ".bias"] = sd[head + "ln.weight"], sd[head + "ln.bias"]
    out["lm_head.weight"] = sd[head + "lm_head.weight"]
    want = set(hf.state_dict())
    if set(out) != want:  # a transformers version with other names: refuse, never half-load
        raise ExportError(f"{type(hf).__name__} of transformers has parameters "
                          f"{sorted(want - set(out))[:4]} that the export does not fill, or "
                          f"lacks {sorted(set(out) - want)[:4]}")
    hf.load_state_dict({k: v.contiguous() for k, v in out.items()})
    return hf.eval()


def to_hf(model, tok: dict | None = None):
    """The transformers model to save for pyfast `model` (a GPT or an HF adapter)."""
    from pyfast.models import GPT
    if isinstance(model, GPT):
        return gpt_to_hf(model, tok)
    hf = getattr(model, "hf", None)
    if hf is not None and hasattr(hf, "save_pretrained"):
        return hf.eval()  # its own architecture: the adapter's "hf." prefix is the attribute
    raise ExportError(f"{type(model).__name__}: no Hugging Face architecture known to have the "
                      "same math (exported: pyfast GPT, and hf: models)")


# ---------------------------------------------------------------- the tokenizer
def data_tokenizer(cfg: TrainConfig, vocab_size: int) -> tuple[dict | None, str]:
    """({"path": tokenizer.json, "eos_id": id or None} or None, what to say about it) for the
    run's --data: a prepared dataset directory names its tokenizer in manifest.json."""
    data = cfg.data
    manifest = Path(data) / "manifest.json" if data else None
    if manifest is None or not manifest.is_file():
        what = "the stdlib sources" if not data else data
        if data and str(data).endswith(".bin"):
            return None, (f"tokenizer: none (--data {what}: token ids with no tokenizer "
                          "recorded; copy the one that made them)")
        return None, f"tokenizer: none (byte-level data, vocab {vocab_size}: {what})"
    try:
        path, eos = tokenizer_file(data)
    except ValueError as e:
        raise ExportError(f"--data {data}: {e}") from None
    if path is None:
        return None, f"tokenizer: none (byte-level data, vocab {vocab_size}: {data})"
    return {"path": Path(path), "eos_id": eos}, f"tokenizer: {path}"


def write_tokenizer(tok: dict, out: Path, vocab_size: int, max_len: int) -> None:
    """tokenizer.json and a tokenizer_config.json that AutoTokenizer reads as a
    PreTrainedTokenizerFast; ExportError if the tokenizer's ids exceed the model's vocab."""
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(str(tok["path"]))
    if t.get_vocab_size() > vocab_size:
        raise ExportError(f"{tok['path']}: {t.get_vocab_size()} tokens, more than the model's "
                          f"vocabulary of {vocab_size}")
    shutil.copyfile(tok["path"], out / "tokenizer.json")
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
            "clean_up_tokenization_spaces": False}
    if tok.get("eos_id") is not None:
        conf["eos_token"] = conf["bos_token"] = t.id_to_token(tok["eos_id"])
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=1) + "\n")


# ---------------------------------------------------------------- the command
def export(run, out, step: int | None = None, to: str = "hf", force: bool = False,
           merge: bool = False, base: bool = False) -> list[str]:
    """Export `run`'s checkpoint (`step`, default the latest complete one) to directory `out`;
    returns the lines to print. Written to a temporary sibling, then renamed into place.
    merge: a LoRA run's adapters merged into its full-precision base; base: that base alone."""
    from pyfast import export_peft as P
    if to not in FORMATS:
        raise ExportError(f"--to {to!r}: unknown format; known: {', '.join(FORMATS)}")
    if (merge or base) and to != "hf":
        raise ExportError(f"--{'merge' if merge else 'base'} writes a whole model: use it with "
                          "--to hf (--to peft writes the adapters alone)")
    if merge and base:
        raise ExportError("--merge and --base: one or the other (the base has no adapters)")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"{out} exists and is not empty: choose another OUT_DIR or pass "
                          "--force to replace it")
    s, path = pick(run, step)
    r = Path(run).resolve()
    if out.resolve() in (r, *r.parents):  # --force would delete the checkpoints
        raise ExportError(f"OUT_DIR {out} is the run directory {run} or holds it")
    meta = ck.read_meta(path)
    cfg = run_config(meta, path)
    if to == "hf" and cfg.lora and not (merge or base):
        raise ExportError(f"{run} is a LoRA run (--lora {cfg.lora}): its checkpoint is a frozen "
                          "base plus adapters; use --to peft for the adapters, or --to hf "
                          "--merge for the adapters merged into the full-precision base")
    if merge and not cfg.lora:
        raise ExportError(f"--merge: {run} was trained without --lora, there are no adapters "
                          "to merge (drop --merge)")
    if to == "peft" and not cfg.lora:
        raise ExportError(f"--to peft: {run} was trained without --lora, there are no adapters "
                          "to export (export the whole model with --to hf)")
    note = ""
    if base:  # the model as the job built it: no checkpoint to read
        model, what = P.base_model(cfg, meta["vocab_size"]), "the run's base (before step 1)"
    else:
        cfg, meta, model = load_model(path)
        what = f"step {s}"
        if to == "peft":
            P.lora_of(model, cfg, path)
        elif merge:
            model, note = P.merged(model, cfg, meta, path), \
                ", LoRA adapters merged into the full-precision base"
    tok, said = data_tokenizer(cfg, meta["vocab_size"])
    hf = to_hf(model, tok) if to == "hf" else None
    tmp = out.parent / f".tmp-export-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if hf is not None:
            hf.save_pretrained(tmp)
            kind = type(hf).__name__
        else:
            kind = P.write_peft(model, cfg, path, tmp)
            said = P.describe(tmp)
        if tok is not None:
            write_tokenizer(tok, tmp, meta["vocab_size"], cfg.seq)
        if out.is_dir():  # --force (checked above)
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mesh = meta.get("mesh", {})
    how = " x ".join(f"{k} {mesh[k]}" for k in ("dp", "cp", "tp", "pp") if k in mesh)
    return [f"pyfast export: {what} of {run} ({cfg.model}, {how}, zero {meta.get('zero', 0)})"
            f" -> {out}: {kind}{note}",
            "files: " + ", ".join(sorted(p.name for p in out.iterdir())), said]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyfast export", description="Export a pyfast train run's "
                                "checkpoint (any mesh, any ZeRO stage) to a Hugging Face "
                                "save_pretrained directory, or a LoRA run's adapters to "
                                "peft's format (--to peft).")
    p.add_argument("run_dir", help="the run's --out directory")
    p.add_argument("out_dir", help="where to write (must be empty or absent unless --force)")
    p.add_argument("--to", required=True, help=f"format: {', '.join(FORMATS)}")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint's step (default: the latest complete one)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    p.add_argument("--merge", action="store_true", help="--to hf of a LoRA run: the adapters "
                   "merged into the full-precision base (W + alpha/r B A)")
    p.add_argument("--base", action="store_true", help="--to hf: the run's full-precision base "
                   "as built from --model and --seed, without adapters (what --to peft's "
                   "adapters load onto)")
    return p


def main(argv=None) -> int:
    ns = parser().parse_intermixed_args(argv)
    try:
        lines = export(ns.run_dir, ns.out_dir, ns.step, ns.to, ns.force, ns.merge, ns.base)
    except ExportError as e:
        print(f"pyfast export: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
