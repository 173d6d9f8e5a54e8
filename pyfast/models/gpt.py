"""A short GPT (Radford et al. 2019, as in nanoGPT): pre-norm blocks, causal self-attention
through F.scaled_dot_product_attention, a GELU MLP, learned or rotary positions (Su et al.
2021, arXiv:2104.09864), optional tied embeddings.

The model IS an nn.Sequential [Embed, Block x n_layer, Head], so pyfast's Pipeline cuts it into
stages as it would any Sequential, and its module names ("0.tok", "3.attn.qkv", "7.lm_head")
are the same on every mesh: checkpoints keyed by them reshard across pipeline layouts.

Fused QKV layout rule: qkv.weight rows are ordered [head, (q, k, v), head_dim] (Megatron's
layout), not [(q, k, v), head, head_dim]. A column split into tp contiguous blocks then gives
each rank whole heads with their q, k and v together, so the attention module needs no
knowledge of tensor parallelism: it infers its local head count from the width it receives.

Context parallelism (GPT.context_parallel): each rank of a cp group holds a shard of every
sequence (pyfast.parallel.context's layout), attention runs over the whole sequence with
context_parallel_attention, and positions (rotary angles, learned embeddings) are the shard's
global ones; everything else in the model is per token and needs no change. The attention
itself is pyfast.parallel's, reached through pyfast._sequence.attention() (models do not import
parallel/): the module that implements it registers it when imported.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pyfast import _sequence
from pyfast._sequence import LAYOUTS, METHODS, sequence_positions


# Split the vocabulary over tp (Megatron's VocabParallelEmbedding + a column-parallel head) only
# from this vocabulary size up. Per token, at tp=2 it saves each rank 3*V*D flops of the head
# and costs two all-reduces of D fp32 values (the embedding's output, the head's input
# gradient): 16*D bytes on a 2-rank link. At 1 Gbit/s and ~50 GFLOP/s a core those balance at
# V = 128/0.06 = 2,133, whatever D. Measured (bench/results/train.txt, gpt-small, V=256): the
# split sent 163.7 MB a step where DTensor TP with a replicated embedding and head sent 151.0.
VOCAB_PARALLEL_MIN = 2048


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int = 256          # the longest sequence (size of the learned position table)
    vocab_size: int = 256       # bytes
    positions: str = "rotary"   # "rotary" or "learned"
    tie_embeddings: bool = False
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    vocab_parallel: bool | None = None  # split embedding and head over tp; None: by size

    @property
    def shard_vocab(self) -> bool:
        return self.vocab_parallel if self.vocab_parallel is not None else \
            self.vocab_size >= VOCAB_PARALLEL_MIN

    def __post_init__(self):
        if self.positions not in ("rotary", "learned"):
            raise ValueError(f"positions must be 'rotary' or 'learned', got {self.positions!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.positions == "rotary" and (self.d_model // self.n_head) % 2:
            raise ValueError(f"rotary positions need an even head size, got "
                             f"{self.d_model // self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


PRESETS = {
    # tests: seconds per step on one core
    "gpt-tiny": dict(n_layer=2, n_head=4, d_model=64),
    # the demo: 10.8M parameters (nanoGPT's shakespeare-char size, 8 heads so tp 2/4/8 divide
    # them); one step of 8 x 256 bytes takes about 1 s on 2 ranks of the 2-core EPYC VM, so
    # `make demo`'s two minutes run ~100 steps and the loss falls from 5.5 to about 2.5
    "gpt-small": dict(n_layer=6, n_head=8, d_model=384),
}


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    # on a meta default device (a model built to be checked, or dry-run) made on the CPU and
    # moved: torch's meta kernels for these are Python references whose first call imports
    # torch._dynamo, 1.1 s of the launcher's check (pyfast.train.config._meta_build)
    meta = torch.get_default_device().type == "meta"
    with torch.device("cpu") if meta else contextlib.nullcontext():
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)  # [T, hd/2]
        cos, sin = angles.cos(), angles.sin()
    return (cos.to("meta"), sin.to("meta")) if meta else (cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, hd]: rotate each (even, odd) pair of the head dimension by its angle."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


@dataclass(frozen=True)
class ContextParallel:
    """How the model's sequences are sharded over a cp group (GPT.context_parallel)."""
    group: object
    layout: str
    method: str
    attention: object  # context_parallel_attention, from pyfast._sequence.attention()

    def positions(self, local_len: int, table: int, what: str, device) -> torch.Tensor:
        """The global positions of this rank's local_len tokens; ValueError if the whole
        sequence is longer than the model's `table` positions."""
        world = dist.get_world_size(self.group)
        if local_len * world > table:
            raise ValueError(f"sequence of {local_len * world} tokens ({local_len} on each of "
                             f"{world} context-parallel ranks) is longer than the model's "
                             f"{table} {what} positions")
        return sequence_positions(local_len * world, self.group, self.layout, device=device)


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.cp: ContextParallel | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.pos is not None and self.cp is not None:  # this shard's global positions
            at = self.cp.positions(ids.shape[-1], self.pos.num_embeddings, "learned", ids.device)
            x = x + self.pos.weight[at]
        elif self.pos is not None:
            if ids.shape[-1] > self.pos.num_embeddings:
                raise ValueError(f"sequence of {ids.shape[-1]} tokens is longer than the "
                                 f"model's {self.pos.num_embeddings} positions")
            x = x + self.pos.weight[: ids.shape[-1]]
        return x


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # rows [head, (q,k,v), head_dim]
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        if cfg.positions == "rotary":
            cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        else:
            self.cos = self.sin = None
        self.cp: ContextParallel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [B, T, 3 * local heads * hd]: local heads = all heads / tp
        b, t = qkv.shape[:2]  # sequence parallel: x holds T / tp tokens, qkv all T (gathered)
        q, k, v = qkv.view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        if self.cp is not None:  # x holds this rank's shard of the sequence
            if self.cos is not None:
                at = self.cp.positions(t, self.cos.shape[0], "rotary", x.device)
                cos, sin = self.cos[at], self.sin[at]
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            y = self.cp.attention(q, k, v, self.cp.group, causal=True, method=self.cp.method,
                                  layout=self.cp.layout)
            return self.proj(y.transpose(1, 2).reshape(b, t, -1))
        if self.cos is not None:
            if t > self.cos.shape[0]:
                raise ValueError(f"sequence of {t} tokens is longer than the model's "
                                 f"{self.cos.shape[0]} rotary positions")
            q, k = apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, h, T, hd]
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)
        self.checkpointed = False  # activation checkpointing: recompute this block in backward
        self.context_fn = None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            kw = {"context_fn": self.context_fn} if self.context_fn is not None else {}
            return checkpoint(self._forward, x, use_reentrant=False, **kw)
        return self._forward(x)


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


class GPT(nn.Sequential):
    """[Embed, Block x n_layer, Head]: token ids [B, T] -> logits [B, T, vocab] (with tensor
    parallelism, this rank's slice of the vocabulary). Initialised as GPT-2/nanoGPT: normal(0,
    0.02) weights, residual projections scaled by 1/sqrt(2 n_layer), zero biases, from torch's
    default generator in a fixed order, so the same seed gives the same full model everywhere."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(Embed(cfg), *(Block(cfg) for _ in range(cfg.n_layer)), Head(cfg))
        self.cfg = cfg
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
        if cfg.tie_embeddings:
            self[-1].lm_head.weight = self[0].tok.weight

    def forward(self, ids: torch.Tensor, hidden: bool = False) -> torch.Tensor:
        """The logits; hidden=True: the residual stream that Head (head_module) reads, the
        model's modules up to the head (a chunked loss runs the head per chunk of tokens)."""
        layers = list(self)
        for m in layers[:-1] if hidden else layers:
            ids = m(ids)
        return ids

    @property
    def head_module(self) -> nn.Module:
        """Head (final LayerNorm + lm_head): forward(ids) == head_module(forward(ids, hidden=True))."""
        return self[-1]

    def enable_activation_checkpointing(self, context_fn=None) -> None:
        """Recompute each block in backward. context_fn: torch.utils.checkpoint's (a pair of
        context managers for the forward and the recomputation; the dry run's casts)."""
        for m in self:
            if isinstance(m, Block):
                m.checkpointed = True
                m.context_fn = context_fn

    def context_parallel(self, group, layout: str | None = None, method: str = "ring") -> None:
        """Shard every sequence over `group` (context parallelism): from now on forward takes
        this rank's shard of the token ids (pyfast.parallel.context.shard_sequence(ids, group,
        dim=1, layout=layout)) and returns the logits of those tokens, every attention layer
        attends over the whole sequence with context_parallel_attention(method, layout), and
        rotary angles and learned positions are the shard's global positions
        (sequence_positions). layout is required: the one the ids were sharded with (no
        default, as in pyfast.parallel.context). Composes with tensor parallelism (each tp
        rank's local heads) and pipeline stages (the layers keep the setting). Collective over
        `group` in every forward and backward, so all its ranks must run the model together."""
        if layout not in LAYOUTS or method not in METHODS:
            raise ValueError(f"context_parallel: layout must be one of {LAYOUTS} and method one "
                             f"of {METHODS}, got {layout!r}, {method!r}")
        cp = ContextParallel(group, layout, method, _sequence.attention())
        for m in self.modules():
            if isinstance(m, (Embed, Attention)):
                m.cp = cp

    @property
    def vocab_parallel(self) -> bool:
        """Whether tensor parallelism splits the vocabulary (then forward returns this rank's
        slice of the logits, for vocab_parallel_cross_entropy), see VOCAB_PARALLEL_MIN."""
        return self.cfg.shard_vocab

    def tp_plan(self, sequence_parallel: bool = False) -> dict:
        """parallelize()'s plan: Megatron's split of attention and MLP, and, for a large
        vocabulary, the vocabulary split in the embedding and the head (whose logits stay
        sharded); a small vocabulary's embedding and head stay whole on every rank.
        sequence_parallel (Korthikanti et al. 2022): between the embedding and the head the
        residual stream is sharded along the sequence (dim 1 of [B, T, h]): the column layers
        all-gather their input, the row layers reduce-scatter their output, the blocks' norms
        sum their gradients over tp; the embedding's output is scattered and the last block's
        gathered, so the head (and --loss-chunks' hidden=True) sees the whole sequence."""
        sp = {"sequence_dim": 1}
        qkv = {"heads": self.cfg.n_head, **({"sequence_parallel": True, **sp}
                                            if sequence_parallel else {})}
        col, row = (("colwise_sp", sp), ("rowwise_sp", sp)) if sequence_parallel else \
            ("colwise", "rowwise")
        plan = {"*.attn.qkv": ("colwise_qkv", qkv),  # checked layout
                "*.attn.proj": row, "*.mlp.fc": col, "*.mlp.proj": row}
        if sequence_parallel:
            plan.update({"*.ln1": ("sequence_norm", sp), "*.ln2": ("sequence_norm", sp),
                         "0": ("sequence_scatter", sp),
                         str(len(self) - 2): ("sequence_gather", sp)})
        if self.vocab_parallel:
            plan.update({"0.tok": "vocab", f"{len(self) - 1}.lm_head": "colwise"})
        return plan

    def tp_check(self, tp: int) -> str | None:
        """Why this model cannot be split over tp ranks, or None."""
        c = self.cfg
        for what, n in (("n_head", c.n_head),
                        ("vocab_size", c.vocab_size if self.vocab_parallel else 0),
                        ("mlp_ratio x d_model", c.mlp_ratio * c.d_model)):
            if n % tp:
                return f"{c.__class__.__name__}: {what} {n} is not divisible by tp={tp}"
        return None

    def retie(self) -> None:
        """After parallelize: the vocabulary-parallel embedding and the column-parallel head hold
        the same rows ([r*V/tp, (r+1)*V/tp)), so a tied model shares one shard again (the
        conversion made two copies)."""
        if self.cfg.tie_embeddings:
            self[-1].lm_head.weight = self[0].tok.weight
