"""One training job on one rank: a model on a dp x cp x tp x pp Mesh, composed from the public
modules exactly as a user would compose them:

    model = models.build(...)                        same seed -> same full model on every mesh
    parallelize(model, model.tp_plan(), group=tp)    tensor parallelism (tp > 1)
    model.context_parallel(cp, layout, method)       context parallelism (cp > 1)
    Pipeline.from_sequential(model, ..., group=pp)   pipeline stages (pp > 1)
    DataParallel(module, compressor, group=dp x cp)  gradient reduction (dp x cp > 1)
    zero(module, AdamW, stage, compressor, group=dp x cp, tp_group=tp, pp_group=pp)
                                                     or sharded data parallelism (--zero 1|2|3)

Gradients are reduced over dp once per optimizer step: without a pipeline, the last piece's
backward reduces (overlapped, DDP-style) and the earlier pieces run under no_sync(); with a
pipeline, DataParallel.reduce_gradients() (or zero's) runs after the last pipeline step.

Context parallelism: the cp ranks of a dp replica read the same batch and each keeps its shard
of every sequence (shard_sequence, --cp-layout), so each computes the mean loss of its equal
share of the tokens; averaging the gradients over dp x cp is then the gradient of the whole
batch's mean loss, and the parameters stay replicated over cp.

LoRA (--lora R, pyfast.models.lora): the model comes out of build_model with its base frozen
(requires_grad=False). Only the trainable parameters (the adapters) go into the optimizer, the
gradient norm and clip, DataParallel's buckets and zero()'s shards: a frozen parameter never
gets a .grad, never enters an optimizer and is never reduced, so a dp step sends adapter bytes
only. Checkpoints hold the trainable parameters and their optimizer state only (Job.state).
Under --precision bf16 the frozen weights and biases of the Linear layers are stored in bf16
(store_frozen_linear: autocast casts them to bf16 for the matmul anyway, so this is exact).

--loss-chunks K (Job.chunked_loss, torchtune's chunked cross-entropy): the model runs up to the
hidden states its LM head reads (forward(ids, hidden=True)), and the head, the fp32 cast and
the cross-entropy run on K chunks of the tokens, each inside a non-reentrant checkpoint: only
the chunk's hidden states are saved and its logits are rebuilt in backward, so a step never
keeps the whole [tokens, vocab] fp32 logits and their softmax (5 GiB a rank at 8B Llama's
128,256 vocabulary, 2 x 2048 tokens). The mean loss is the same quantity (a sum of chunk sums
over the token count). Validation keeps the unchunked path (no_grad saves nothing).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pyfast import models
from pyfast._ranges import span
from pyfast.comm.dry import read
from pyfast.data import Batches, load_corpus
from pyfast.errors import NonFiniteError  # defined below train/ (outer.py raises it too)
from pyfast.optim import job_adamw
from pyfast.perf import clock
from pyfast.parallel import DataParallel, Mesh, Pipeline, parallelize, vocab_parallel_cross_entropy
from pyfast.parallel.context import shard_sequence
from pyfast.parallel.zero import checkpoint as zck
from pyfast.parallel.zero import zero
from pyfast.parallel.zero.frozen import decide as decide_frozen

from . import checkpoint as ck
from . import batch_split, offload, outer, pp_balance, rebalance
from .ft_step import replicas as ft_replicas
from .config import (ConfigError, TrainConfig, build_model, check_data, check_model,
                     check_shard_group, lora_options)
from .telemetry import bytes_written

AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp16: a run of skipped (overflowing) steps this long is a broken run, not loss scaling
# finding its level (GradScaler halves the scale per skip: 10 skips = 1/1024 of the scale).
MAX_SKIPS = 10


def local_world(cfg: TrainConfig) -> int | None:
    """The ranks on this node (LOCAL_WORLD_SIZE: torchrun and pyfast's launcher set it), for
    --zero-shard-group; ConfigError if `node` asks for it and it is not set."""
    v = os.environ.get("LOCAL_WORLD_SIZE")
    if not v and cfg.zero_shard_group == "node":
        raise ConfigError("--zero-shard-group node: LOCAL_WORLD_SIZE (the ranks on this node) is "
                          "not set; launch with torchrun or pyfast train, or give N")
    return int(v) if v else None


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to lr over the first `warmup` steps, then cosine down to
    lr * min_lr_ratio at step --lr-decay-steps (default the last step: nanoGPT with
    lr_decay_iters = max_iters), constant after it."""
    w, n, lo = cfg.warmup_steps, cfg.lr_decay_steps or cfg.steps, cfg.min_lr_ratio

    def f(i: int) -> float:  # i: optimizer steps taken so far (LambdaLR's epoch)
        if i < w:
            return (i + 1) / w
        t = min(1.0, (i - w) / max(1, n - 1 - w))
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def meta_recompute(dtype):
    """torch.utils.checkpoint's context_fn for a dry run: the recomputation runs under the same
    MetaAutocast as the forward (torch's own autocast restore skips the meta device)."""
    from .meta_autocast import MetaAutocast, POLICY
    return lambda: (contextlib.nullcontext(), MetaAutocast(dtype, POLICY))


def autocast_layers(model, device_type: str, dtype) -> None:
    """Run every top-level layer's forward under autocast (fp32 master weights stay fp32).
    Per layer rather than around the step, so that whatever runs a layer (the plain loop or a
    pipeline stage) autocasts its forward and no backward runs inside an autocast region.
    On the meta device (a dry run) MetaAutocast instead (dtype None: fp32, GPU attention)."""
    layers = list(model) if models.pipelinable(model) else [model]
    for m in layers:
        if device_type == "meta":  # a dry run: autocast casts no meta tensor (meta_autocast.py)
            from .meta_autocast import autocast_forward
            m.forward = autocast_forward(m.forward, dtype)
        else:
            m.forward = torch.autocast(device_type, dtype=dtype)(m.forward)


def store_frozen_linear(model, dtype) -> int:
    """Store the frozen floating weights and biases of every nn.Linear / QuantLinear of `model`
    in `dtype`, in place; returns the elements converted. Exact under autocast to `dtype`:
    autocast casts a Linear's weight and bias to it before the matmul (round to nearest, as
    this cast), so the forward is bit-identical (tests/test_lora.py) and a frozen base is not
    kept in fp32 only to be cast every step (accelerate#3844).
    Not the embeddings, norms or a head tied to the embedding: they are not autocast (a bf16
    embedding makes the whole residual stream bf16; a bf16 RMSNorm/LayerNorm weight makes its
    output bf16): measured on gpt-tiny and hf-llama-tiny with LoRA, storing every frozen
    tensor in bf16 moved the logits by 4e-3, these only by 0."""
    from torch import nn

    from pyfast.models.quant_base import QuantLinear
    owners: dict[int, int] = {}  # parameter -> modules holding it (a tied head is shared)
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    n = 0
    for m in model.modules():
        if not isinstance(m, (nn.Linear, QuantLinear)):
            continue
        for name in ("weight", "bias"):
            p = m._parameters.get(name)
            if p is None or p.requires_grad or not p.is_floating_point() or p.dtype == dtype \
                    or owners[id(p)] > 1:
                continue
            p.data = p.data.to(dtype)
            n += p.numel()
    return n


class Job:
    def __init__(self, cfg: TrainConfig, device: torch.device, data: dict | None = None):
        """data: the data's fingerprint (config.check_data), computed here if not given."""
        self.cfg, self.device = cfg, device
        # --zero-shard-group: hybrid sharding over shard groups of this size (None: dp x cp)
        self.shard_size = check_shard_group(cfg, local_world(cfg)) if cfg.zero else None
        self.mesh = mesh = Mesh(cfg.dp, cfg.tp, cfg.pp, cp=cfg.cp, replicas=cfg.replicas,
                                shard=self.shard_size)
        # ConfigError (the same on every rank) rather than load_corpus's errors
        self.data = data if data is not None else check_data(cfg)
        self.corpus = load_corpus(cfg.data)
        torch.manual_seed(cfg.seed)  # before the model: every mesh draws the same full weights
        # a dry run builds on the meta device directly: a 7B-shaped model's fp32 init (28 GB)
        # would not fit in the host's memory, and meta tensors hold no values to draw anyway
        model = build_model(cfg, self.corpus.vocab_size, device if device.type == "meta" else None)
        check_model(cfg, model)
        # the embedding's rows: the data's vocabulary for pyfast's GPT, the config's for hf:DIR
        # (which may exceed the data's; export sizes its tokenizer check by it)
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None) \
            or self.corpus.vocab_size
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        model.to(device)
        if cfg.activation_checkpointing:  # a dry run recomputes under its casts too
            model.enable_activation_checkpointing(
                **({"context_fn": meta_recompute(AMP.get(cfg.precision))}
                   if device.type == "meta" else {}))
        if cfg.tp > 1:
            try:
                plan = model.tp_plan(sequence_parallel=True) if cfg.sequence_parallel else \
                    model.tp_plan()
                parallelize(model, plan, group=mesh.tp_group)
            except ValueError as e:  # the same on every rank (e.g. a plan that meets an adapter)
                lora = f" with --lora {cfg.lora}" if cfg.lora else ""
                raise ConfigError(f"--tp {cfg.tp}{lora}: {e}") from None
            model.retie()
        if cfg.cp > 1:  # after tp: attention then runs over each tp rank's local heads
            model.context_parallel(mesh.cp_group, layout=cfg.cp_layout, method=cfg.cp_method)
        if cfg.precision == "bf16" and self.n_trainable < self.n_params:  # a frozen base
            store_frozen_linear(model, torch.bfloat16)
        if cfg.precision in AMP or device.type == "meta":  # meta: GPU attention (meta_autocast)
            autocast_layers(model, device.type, AMP.get(cfg.precision))
        self.model, self.mult, self.scaling = model, 1.0, False
        self.pipe = None
        if cfg.pp > 1:
            # fused backward unless the schedule needs the split (zb-h1): 3% faster on gpt-small
            self.pipe = Pipeline.from_sequential(model, cfg.m, cfg.schedule, self.loss_fn,
                                                 group=mesh.pp_group,
                                                 virtual_stages=cfg.virtual_stages,
                                                 split_backward=False,
                                                 stage_costs=pp_balance.stage_costs(cfg, device))
        self.pipe_s = [0.0, 0.0]  # the last step's pipeline (idle, wall) seconds: pp_idle
        module = self.pipe if self.pipe is not None else model
        # this rank's trainable parameters (a pipeline's own stages; by identity, not by device:
        # the others' layers are on the meta device, and so is everything in a dry run). A
        # frozen one (a LoRA base) is in none of what follows: optimizer, norm, checkpoint
        mine = {id(p) for p in module.parameters() if p.requires_grad}
        self.named = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
        self.params = [p for _, p in self.named]
        decay = [p for p in self.params if p.dim() >= 2]
        rest = [p for p in self.params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": rest, "weight_decay": 0.0}]
        self.dp = self.zero = self.replicas = None
        # --batch-split: this dp rank's rows of each global batch, its gradient weighted by them
        self.split = batch_split.split_of(cfg)
        samples = batch_split.samples(self.split, mesh.dp_rank)
        self.frozen_note = None  # --lora --zero 3: where the frozen base lives, and why
        if cfg.ft:  # --ft: this group's torchft Replicas, before what reduces through it
            self.replicas = ft_replicas(cfg, device)
        if cfg.zero:  # config.check_zero; shards each tp / pp shard over its dp x cp ranks
            frozen = "replicate"
            if cfg.zero == 3 and cfg.lora:
                frozen, self.frozen_note = decide_frozen(module, cfg.base_placement,
                                                         cfg.base_dtype,
                                                         self.shard_size or cfg.dp * cfg.cp, device,
                                                         host=cfg.offload == "params")
            # hybrid (--zero-shard-group): --compress is the cross-group all-reduce's, the
            # reduce-scatter inside the group exact (docs/zero.md, "Hybrid sharding")
            hybrid = self.shard_size is not None
            self.zero, self.opt = zero(
                module, offload.optim_cls(cfg, device), stage=cfg.zero, frozen=frozen,
                **offload.zero_kwargs(cfg),  # --offload (pyfast.train.offload)
                compressor=None if hybrid else cfg.compress,
                replica_group=mesh.shard_replica_group if hybrid else None,
                replica_compressor=cfg.compress if hybrid else None,
                param_compressor=None if cfg.param_compress == "none" else cfg.param_compress,
                group=mesh.shard_group, params=groups, lr=cfg.lr, betas=(0.9, 0.95),
                tp_group=mesh.tp_group if cfg.tp > 1 else None,
                pp_group=mesh.pp_group if cfg.pp > 1 else None,
                # every rank builds its zero() here, so the native engine's private group (made
                # over the default group) may serve a subgroup too: HSDP int8 at 1 Gbit/s 697 ms a
                # step with it, 759-820 with the Python worker (bench/results/hsdp_*)
                every_rank=True, samples=samples,
                error_feedback=cfg.error_feedback == "on",
                **({"bucket_mb": cfg.bucket_mb} if cfg.bucket_mb else {}))
        elif cfg.dp * cfg.cp > 1 or (cfg.ft and not cfg.diloco):
            # fp16: GradScaler overflows by design (gpt-tiny's first step at scale 2^16 already
            # does); "skip" sends an overflowing bucket as zeros and puts every feedback memory
            # back, so the skipped step leaves no NaN in it. Otherwise a NaN/Inf stops the run
            # before the update (train_step), so the 3% the check costs (benchmarks.md) is saved.
            finite = "skip" if cfg.precision == "fp16" else False
            # --ft: torchft's replica groups too (exact inside the group, --compress across
            # them: pyfast.parallel.ft_reduce), even with one rank a group; not with --diloco
            # (the groups meet at DiLoCo's outer steps only)
            self.dp = DataParallel(module, compressor=cfg.compress, group=mesh.dp_cp_group,
                                   replicas=None if cfg.diloco else self.replicas,
                                   check_finite=finite, error_feedback=cfg.error_feedback == "on",
                                   samples=samples,
                                   **({"bucket_mb": cfg.bucket_mb} if cfg.bucket_mb else {}))
        self.net = self.dp or self.zero or module
        # the global gradient norm counts each element once: tp-replicated tensors (LayerNorm,
        # row-parallel biases) on tp rank 0 only, and everything on dp and cp rank 0 only
        first = mesh.dp_rank == 0 and mesh.cp_rank == 0
        self.counted = torch.tensor([first and (mesh.tp_rank == 0 or
                                     getattr(p, "tensor_parallel", False)) for p in self.params],
                                    dtype=torch.bool, device=device)
        # one rank per dp replica, cp shard and tp group holds the loss: a last stage, tp rank 0
        self.owns_loss = mesh.is_last_stage and mesh.tp_rank == 0
        if self.zero is None:
            # pyfast's fused C++ AdamW on CPU, torch's elsewhere (pyfast.optim.job_adamw)
            self.opt = job_adamw(groups, device, lr=cfg.lr, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.scaler = None
        if cfg.precision == "fp16":  # a dry run's: no host read of the scale or found_inf
            from .meta_autocast import MetaGradScaler
            self.scaler = MetaGradScaler() if device.type == "meta" else \
                torch.amp.GradScaler(device.type) if self.zero is None else self._zero_scaler()
            if self.zero is not None:  # ZeroGradScaler's staging, on meta too: the dry run's
                self.zero.stage_feedback(True)  # memory holds the staged feedback (2x)
            if self.pipe is not None and device.type != "meta":
                # only the last stage scales a loss, and GradScaler makes its scale there; the
                # other stages' gradients come from that scaled loss and are unscaled by the
                # same init scale (unscale_ raised "_scale is None" on them, --pp 2 --dp 2)
                self.scaler.scale(torch.zeros((), device=device))
        # --diloco: the inner optimizer steps through DiLoCo over the replica group (outer.py)
        # (with --zero 1|2 DiLoCo sets the parameters zero's optimizer steps views of)
        self.diloco = outer.build(cfg, self.zero if self.zero is not None else module,
                                  self.opt, mesh, self.replicas) if cfg.diloco else None
        self.outer = outer.Meter() if cfg.diloco else None
        # --replicas R > 1: the step's small all-reduce runs over this replica's own ranks, and
        # the replicas compare losses and NaN/Inf verdicts only where they meet (outer.Meeting)
        self.step_group = outer.replica_ranks(mesh) if cfg.replicas > 1 else None
        self.meeting = outer.Meeting(self) if cfg.replicas > 1 else None
        # replicas x dp ranks partition each global batch as dp ranks alone do (one replica:
        # exactly the dp slices), so a run at --replicas R sees the tokens of --dp R x dp
        self.batches = Batches(self.corpus.train, cfg.batch, cfg.seq, cfg.seed,
                               *self.data_slot, split=self.split)
        # --batch-split auto: measure, all-gather every K steps, re-split (pyfast.train.rebalance)
        self.balancer, self.split_note = batch_split.balancer(self), None
        self.skips = 0
        self.carried = 0  # bytes written after the last step's count, counted in this one
        # --diloco with an outer all-reduce in flight at a step's end: where that step's count
        # ended. The next step counts from there what the transfer wrote between the two, less
        # the caller's own writes inside not_sent() (a run's log, checkpoints, samples)
        self.mark: int | None = None
        # --ft: this group's torchft step (quorum, heal, cross-group average, commit)
        self.ft = None
        if cfg.ft:
            from .ft_step import FTStep
            self.ft = FTStep(self)

    @property
    def data_slot(self) -> tuple[int, int]:
        """(this rank's slice of a global batch, the number of slices): replica-major."""
        if self.cfg.ft and self.cfg.diloco:  # group N reads slice N mod M (pyfast.train.ft)
            m = self.cfg.min_replicas
            return self.cfg.replica_id % m * self.cfg.dp + self.mesh.dp_rank, m * self.cfg.dp
        return self.mesh.replica_rank * self.cfg.dp + self.mesh.dp_rank, \
            self.cfg.replicas * self.cfg.dp

    @contextlib.contextmanager
    def not_sent(self):
        """Writes between steps that are not sent bytes (files, the terminal): left out of
        the next step's bytes_sent when it counts from `mark` (what an in-flight transfer
        writes meanwhile is left out with them)."""
        if self.mark is None:
            yield
            return
        w = bytes_written()
        try:
            yield
        finally:  # only train_step clears the mark
            self.mark += bytes_written() - w

    def scalar(self, x: float) -> torch.Tensor:
        """An fp64 scalar on the job's device: the step's sums and its all-reduce stay where the
        gradients are (NCCL takes CUDA tensors only)."""
        return torch.tensor(x, dtype=torch.float64, device=self.device)

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of the batch's sequences (all of them when cp == 1)."""
        if self.cfg.cp == 1:
            return x, y
        g, layout = self.mesh.cp_group, self.cfg.cp_layout
        return (shard_sequence(x, g, dim=1, layout=layout),
                shard_sequence(y, g, dim=1, layout=layout))

    # ---------------------------------------------------------------- loss
    def loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the piece's tokens, times self.mult (1/pieces) and, when
        training in fp16, GradScaler's scale; in fp32 whatever the autocast dtype."""
        logits, target = logits.flatten(0, -2).float(), target.flatten()
        if self.cfg.tp > 1 and self.model.vocab_parallel:
            loss = vocab_parallel_cross_entropy(logits, target, group=self.mesh.tp_group)
        else:
            loss = F.cross_entropy(logits, target)
        loss = loss * self.mult
        return self.scaler.scale(loss) if self.scaler is not None and self.scaling else loss

    def piece_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """loss_fn of the model's logits for x, or, with --loss-chunks, chunked_loss."""
        if not self.cfg.loss_chunks:
            return self.loss_fn(self.net(x), y)
        return self.chunked_loss(self.net(x, hidden=True), y)

    def chunked_loss(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """loss_fn(head(h), target) with the head and the loss run on cfg.loss_chunks chunks of
        the tokens (ragged: the first N % K chunks hold one token more), each checkpointed.
        The head runs under the job's autocast (MetaAutocast on the meta device) in forward
        and in the recomputation: _chunk_sum enters it. Under --zero 3 a head that is a unit of
        its own (GPT's Head) is gathered and freed once a chunk in forward and twice in backward
        (recomputation, then its output's gradient hook); an HF lm_head belongs to the root's
        unit, gathered from the wrapper's forward to the end of backward."""
        h, target = h.flatten(0, -2), target.flatten()
        n, k = target.numel(), min(self.cfg.loss_chunks, target.numel())
        sizes = [n // k + (i < n % k) for i in range(k)]
        # one split (one backward node that concatenates the chunks' gradients), not K slices
        hs, ts = torch.split(h, sizes), torch.split(target, sizes)
        # _chunk_sum enters the autocast itself, so the recomputation runs under the same one
        # on every device (meta included: no context_fn needed, unlike meta_recompute's blocks)
        total = sum(checkpoint(self._chunk_sum, hc, tc, use_reentrant=False)
                    for hc, tc in zip(hs, ts))
        loss = total / n * self.mult
        return self.scaler.scale(loss) if self.scaler is not None and self.scaling else loss

    def _chunk_sum(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The summed fp32 cross-entropy of one chunk of tokens, through the model's head."""
        dtype = AMP.get(self.cfg.precision)
        if self.device.type == "meta":  # autocast_layers' casts, here for the head alone
            from .meta_autocast import POLICY, MetaAutocast
            amp = MetaAutocast(dtype, POLICY)
        elif dtype is not None:
            amp = torch.autocast(self.device.type, dtype=dtype)
        else:
            amp = contextlib.nullcontext()
        with amp:
            logits = self.model.head_module(h)
        return F.cross_entropy(logits.float(), target, reduction="sum")

    # ---------------------------------------------------------------- one optimizer step
    def _forward_backward(self, x, y) -> tuple[torch.Tensor, float]:
        """(sum of the pieces' weighted losses on this rank, seconds waited on communication).
        Without a pipeline the m micro-batches run one after another as more accumulation."""
        pieces = self.cfg.grad_accum * (self.cfg.m if self.pipe is None else 1)
        self.mult, self.scaling = 1.0 / pieces, True
        try:
            run = self._pipelined if self.pipe is not None else self._accumulated
            return run(x.chunk(pieces), y.chunk(pieces))
        finally:
            self.scaling = False

    def _accumulated(self, xs, ys) -> tuple[torch.Tensor, float]:
        total = self.scalar(0.0)
        for i, (x, y) in enumerate(zip(xs, ys)):
            last = i == len(xs) - 1  # the DDP pattern: only the last backward reduces
            wrapper = self.dp or self.zero
            sync = contextlib.nullcontext() if wrapper is None or last else wrapper.no_sync()
            with sync:
                loss = self.piece_loss(x, y)
                loss.backward()
            total += loss.detach().double()
        return total, self.dp.last_wait_s if self.dp is not None else 0.0

    def _pipelined(self, xs, ys) -> tuple[torch.Tensor, float]:
        total, waited, self.pipe_s = self.scalar(0.0), 0.0, [0.0, 0.0]
        for x, y in zip(xs, ys):
            loss = self.pipe.step(x, y)  # x used on the first stage, y on the last
            waited += self.pipe.last_stats["idle"]
            self.pipe_s = [self.pipe_s[0] + self.pipe.last_stats["idle"],
                           self.pipe_s[1] + self.pipe.last_stats["wall"]]
            if loss is not None:
                total += loss.double()
        if self.dp is not None:
            self.dp.reduce_gradients()
            waited += self.dp.last_wait_s
        if self.zero is not None and self.cfg.zero > 1:  # after the rank's last backward
            # of the step (zero's meshes.py); stage 1 reduces in the optimizer, as always
            tw = clock(self.device)
            self.zero.reduce_gradients()
            waited += clock(self.device) - tw
        return total, waited

    def train_step(self, step: int) -> dict:
        if self.ft is not None and not self.cfg.diloco:
            return self.ft.train_step(step)
        cfg = self.cfg
        t0, w0 = clock(self.device), bytes_written()  # clock: on CUDA, after the queued work
        if self.mark is not None:  # an outer all-reduce ran on between the steps
            self.carried, self.mark = self.carried + w0 - self.mark, None
        c0 = self._cross_bytes()
        self.opt.zero_grad(set_to_none=True)
        x, y = self.shard(*self.batches.next())
        x, y = x.to(self.device), y.to(self.device)
        if self.balancer is not None:  # forward + backward's seconds, less its waits
            self.balancer.begin()
        local, waited = self._forward_backward(x, y)
        if self.balancer is not None:
            self.balancer.end(waited, len(x))
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        if self.zero is not None:
            self.opt.reduce_gradients()  # before unscale_: stage 1 reduces in the step
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.zero is not None:
            sq, bad = self._zero_norm()
            if hasattr(self.scaler, "found_inf"):  # a unit sent as zeros (ZeroGradScaler)
                bad = bad + self.scaler.found_inf(self.opt).double().sum()
        else:
            have = [i for i, p in enumerate(self.params) if p.grad is not None]
            grads = [self.params[i].grad for i in have]
            # one fused pass (torch._foreach_norm, as clip_grad_norm_), squares summed in fp64
            norms = torch.stack(torch._foreach_norm(grads)).double() if grads else \
                torch.zeros(0, dtype=torch.float64, device=self.device)
            # a mask, not boolean indexing: its size depends on data (no meta kernel: dry run)
            sq = torch.where(self.counted[have], norms.square(), 0.0).sum()
            bad = (~torch.isfinite(norms).all()).double()  # on the device: no host read
        # the logged loss: the mean of the batch's (R > 1: this replica's slice's) losses
        contrib = batch_split.mean_of(local / scale, self.split, self.mesh.dp_rank,
                                      cfg.dp * cfg.cp, cfg.batch) \
            if self.owns_loss else self.scalar(0.0)
        w1 = bytes_written()  # what is written after this (--diloco: outer.Meter.settle)
        sent, self.carried = w1 - w0 + self.carried, 0
        tc = clock(self.device)
        cross = self._cross_bytes() - c0
        vec = torch.stack([contrib, sq, bad, self.scalar(float(sent)), self.scalar(float(cross))])
        if self.pipe is not None:  # each stage's idle fraction rides along (pp_balance)
            vec = torch.cat([vec, pp_balance.idle_slots(self, *self.pipe_s)])
        # one small all-reduce: loss, norm, NaN/Inf and bytes over every rank, or with R > 1
        # over this replica's ranks only (each replica clips by its own gradient's norm)
        dist.all_reduce(vec, group=self.step_group)
        waited += clock(self.device) - tc
        vals = self._read(vec)  # the step's one host read
        loss, gnorm = vals[0], math.sqrt(vals[1])  # a sum of squares: NaN or >= 0
        skipped = held = False
        if self.meeting is not None:  # NonFiniteError on every rank if a replica failed
            tm = clock(self.device)
            held = self.meeting.step(step, loss, gnorm, vals)
            waited += clock(self.device) - tm
        if held:  # this replica went NaN/Inf since the replicas last met: no update till then
            skipped = True
        elif vals[2] > 0 or not math.isfinite(loss) or not math.isfinite(gnorm):
            if self.scaler is None:
                raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {gnorm} (NaN/Inf "
                                     f"on {int(vals[2])} rank(s)); stopping before the update, "
                                     f"the last complete checkpoint is kept")
            skipped = self._skip(step)
        else:
            self.skips = 0
            if cfg.clip > 0 and gnorm > cfg.clip:  # torch's rule, global norm
                if self.zero is not None:
                    self.opt.clip_(self.scalar(gnorm), cfg.clip)
                else:
                    torch._foreach_mul_(grads, cfg.clip / (gnorm + 1e-6))
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            elif self.diloco is not None:
                waited += self.outer.step(self)  # the inner step, + the outer one when due
            else:
                with span("pyfast.optim.step"):
                    self.opt.step()
        lr = self.opt.param_groups[0]["lr"]
        self.sched.step()
        step_s = clock(self.device) - t0
        rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm,
               "tokens_per_s": cfg.batch * cfg.seq / step_s, "step_ms": 1e3 * step_s,
               "compute_ms": 1e3 * (step_s - waited), "exposed_comm_ms": 1e3 * waited,
               "bytes_sent": int(vals[3]), **batch_split.record(self.split)}
        if self.pipe is not None:  # the bubble each stage saw (pp_balance), idle / wall
            rec["pp_idle"] = [round(f, 4) for f in vals[5:5 + cfg.pp]]
        if self.shard_size is not None:  # hybrid sharding: the cross-group (node) share of them
            rec["cross_node_bytes"] = int(vals[4])
        if self.scaler is not None:
            rec.update(loss_scale=scale, skipped=skipped)
        if self.outer is not None:  # the bytes after w1 (the outer all-reduce's among them)
            rec["bytes_sent"] += self.outer.settle(self, step, w1)
            rec.update(self.outer.record())
        if self.meeting is not None:
            rec.update(self.meeting.record())
        if self.ft is not None:  # --ft --diloco: the outer step's verdict; a heal moves the step
            rec.update(self.ft.outer_record())
        rebalance.after_step(self, step, rec)  # --batch-split auto: the next steps' split
        return rec

    def _cross_bytes(self) -> int:
        """Bytes this rank sent so far across the shard groups (hybrid sharding: the replica
        all-reduces' payloads, pyfast.parallel.zero.hybrid); 0 without."""
        reps = getattr(self.zero, "replicas", None)
        return reps.bytes_sent if reps is not None else 0

    def compression_error(self) -> float | None:
        """--compress's relative error ||D(C(g)) - g|| / ||g|| on the gradient the last step
        applied (each of this rank's tensors through a fresh codec: no error feedback, no warm
        start; squares summed over all ranks, each element counted once as in the gradient
        norm): what metrics.jsonl and TensorBoard log at eval steps. None, the same on every
        rank, without a lossy fixed compressor or under ZeRO (whose ranks hold gradient shards).
        Collective: every rank calls it."""
        spec = self.cfg.compress
        if spec in ("none", "auto") or self.zero is not None:
            return None
        import pyfast.compress as C
        c, acc = C.get(spec), torch.zeros(2, dtype=torch.float64, device=self.device)
        for (name, p), counted in zip(self.named, self.counted.tolist()):  # eval steps only
            if p.grad is not None and counted:
                g = p.grad.detach()
                d = c.decompress(c.compress(g, name))
                acc += torch.stack([(d.double() - g.double()).square().sum(),
                                    g.double().square().sum()])
        dist.all_reduce(acc)
        err, norm = acc.tolist()
        return math.sqrt(err / norm) if norm > 0 else None

    def _read(self, vec: torch.Tensor) -> list[float]:
        """vec's values on the host. A dry run's meta tensors hold none: a finite step whose
        gradient norm is clipped (twice --clip) stands in, so every branch of a step runs."""
        sq = (2.0 * max(self.cfg.clip, 1.0)) ** 2
        return read(vec, [0.0, sq, 0.0, 0.0, 0.0] + [0.0] * (len(vec) - 5))

    def _zero_scaler(self):
        """--zero with fp16: torch's ShardedGradScaler on the master shards, fixed for zero
        (pyfast.parallel.zero.scaler); found_inf joins the step's one all-reduce (agree=False)
        and _skip sets it on every rank, which rolls the feedback memory back."""
        from pyfast.parallel.zero.scaler import ZeroGradScaler
        return ZeroGradScaler(self.device.type, optimizer=self.opt, agree=False)

    def _zero_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share of the squared global gradient norm, NaN/Inf flag) under zero, on
        any mesh: ZeroOptimizer.norm_sq counts each element once (its own shard over dp x cp,
        tp-replicated tensors on tp rank 0, each pp stage its own), so the step's one
        all-reduce over every rank sums the global norm, with no collective of its own; the
        clip (torch's rule) follows on the shards (ZeroOptimizer.clip_)."""
        return self.opt.norm_sq()

    def _skip(self, step: int) -> bool:
        """fp16 overflow somewhere in the mesh: every rank skips this update and backs off the
        scale. GradScaler only saw this rank's gradients, so its per-device found_inf flags
        (torch.amp.GradScaler's _per_optimizer_states) are set to the mesh-wide answer."""
        self.skips += 1
        if self.skips > MAX_SKIPS:
            raise NonFiniteError(f"step {step}: {self.skips} fp16 steps in a row overflowed "
                                 f"(loss scale {self.scaler.get_scale()}); stopping")
        state = self.scaler._per_optimizer_states[id(self.opt)]
        for flag in state["found_inf_per_device"].values():
            flag.fill_(1.0)
        self.scaler.step(self.opt)  # skips: found_inf is set
        self.scaler.update()
        return True

    # ---------------------------------------------------------------- validation
    @torch.no_grad()
    def evaluate(self) -> float:
        cfg = self.cfg
        n = min(cfg.eval_batches, (len(self.corpus.val) - 1) // cfg.seq // cfg.batch)
        if n < 1:  # the validation split holds less than one global batch (same on every rank)
            return math.nan
        val = Batches(self.corpus.val, cfg.batch, cfg.seq, cfg.seed, *self.data_slot,
                      shuffle=False, split=self.split)
        old, self.mult = self.mult, 1.0
        total, count = self.scalar(0.0), 0
        was = self.model.training  # validation in eval mode (no dropout), the mode kept after
        self.model.eval()
        try:
            for _ in range(n):
                x, y = self.shard(*val.next())
                for xk, yk in zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum)):
                    if self.pipe is None:
                        fwd = self.zero if self.zero is not None else self.model  # stage 3 gathers
                        total += self.loss_fn(fwd(xk.to(self.device)), yk.to(self.device))
                    else:
                        out = self.pipe(xk.to(self.device))
                        if out is not None:
                            total += self.loss_fn(out, yk.to(self.device))
                    count += 1
        finally:
            self.mult = old
            self.model.train(was)
        ways = cfg.replicas * cfg.dp * cfg.cp  # the mean over replicas of each one's loss
        v = batch_split.mean_of(total / count, self.split, self.mesh.dp_rank, ways, cfg.batch) \
            if self.owns_loss else self.scalar(0.0)
        dist.all_reduce(v)
        return float(v)

    def evaluate_outer(self) -> float:
        """evaluate() on the outer (global) parameters DiLoCo's outer optimizer holds, as the
        DiLoCo papers evaluate; the replicas' own parameters are put back bit for bit."""
        with outer.swapped(self.diloco):
            return self.evaluate()

    # ---------------------------------------------------------------- checkpoints
    def state(self, full: bool, replica: int | None = None, pending: int | None = -1) -> dict:
        """What a checkpoint holds. full=False leaves out the per-rank part (RNG states and
        compression / error-feedback memory), which only means something on the same mesh.
        --diloco (outer.state): replica: whose local state (default this rank's replica);
        pending: -1 to save, else the fragment in flight a load reads (None: none).

        "model" and "optim" hold the trainable parameters only (self.named). With --lora the
        frozen base is not saved: it is rebuilt, bit for bit, from what --resume requires to
        be unchanged (--model and its files, --seed, --base-dtype, the LoRA flags: the base is
        drawn or loaded before the adapters, config.build_model), so a checkpoint of a 70B
        base's adapters is the adapters' size (megabytes), not the base's (140 GB in bf16)
        every --ckpt-every steps. An exporter of such a checkpoint rebuilds the base the same
        way (meta.json records "lora" and "base_dtype") and reads the adapters from here.
        Under --zero the state is pyfast.parallel.zero.checkpoint's, which still writes the
        frozen parameters whole (its load_target requires every parameter of the module)."""
        if self.zero is not None:  # flat shards by FQN: pyfast.parallel.zero.checkpoint
            zsd = zck.get_state_dict(self.zero, self.opt)
            model, optim = zsd["model"], zsd["optim"]
        else:
            model, optim = self._dense_state()
        train = {"sched": self.sched.state_dict(), "data": self.batches.state_dict(),
                 "lrs": [g["lr"] for g in self.opt.param_groups], "skips": self.skips,
                 "batch_split": self.split,  # --batch-split's, in force
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        state = {"model": model, "optim": optim, "train": ck.blob(train)}
        if self.diloco is not None:
            k = self.mesh.replica_rank if replica is None else replica
            state = outer.state(self, state, k, pending)
        if full:
            mine = {"rng": torch.get_rng_state(), "comm": self._compression_state()}
            if self.diloco is not None:
                mine.update(outer.rank_state(self))
            state[f"rank{dist.get_rank()}"] = ck.blob(mine)
        return state

    def _compression_state(self) -> dict | None:
        """This rank's error-feedback memory (DataParallel's, or zero's gradient compressor's)."""
        if self.dp is not None:
            return self.dp.compression_state_dict()
        if self.zero is not None:
            c, reps = self.zero.compressor, self.zero.replicas
            return {"spec": c.spec, "state": c.state_dict(),
                    **({"replica": reps.compressor.state_dict()} if reps is not None else {})}
        return None

    def _dense_state(self) -> tuple[dict, dict]:
        """Whole tensors by FQN (DTensors over the tp sub-mesh for tp shards)."""
        tp_mesh = self.mesh.device_mesh["tp"] if self.cfg.tp > 1 else None
        model = {n: ck.shard(p.detach(), p, tp_mesh) for n, p in self.named}
        optim = {}
        for n, p in self.named:
            st = self.opt.state[p]
            if not st:  # before the first step: the tensors a step would make, to load into
                st.update(step=torch.zeros((), dtype=torch.float32),
                          exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            optim[n] = {"step": st["step"], "exp_avg": ck.shard(st["exp_avg"], p, tp_mesh),
                        "exp_avg_sq": ck.shard(st["exp_avg_sq"], p, tp_mesh)}
        return model, optim

    def meta(self) -> dict:
        c = self.cfg
        return {"model_key": c.model_key(), "vocab_size": self.vocab_size,
                "mesh": {"dp": c.dp, "cp": c.cp, "tp": c.tp, "pp": c.pp,
                         **({"replicas": c.replicas} if c.diloco else {})},
                "compress": c.compress,
                "precision": c.precision, "batch": c.batch, "n_params": self.n_params,
                "trainable_params": self.n_trainable,
                # LoRA: the checkpoint holds the adapters only (state); the base is rebuilt
                "lora": lora_options(c).describe() if c.lora else None,
                "base_dtype": c.base_dtype if c.lora else None,
                "zero": c.zero, "param_compress": c.param_compress,
                "zero_shard_group": c.zero_shard_group,
                "error_feedback": c.error_feedback,
                # the run's record, which --resume compares (config.resume_changes)
                "config": dataclasses.asdict(c), "warmup_steps": c.warmup_steps,
                "data": self.data}

    def save(self, out, step: int, fault=None, keep_last: int = 0):
        return ck.save(self.state(full=True), out, step, self.meta(), fault, keep_last)

    def load(self, path) -> tuple[int, bool]:
        """Restore from a checkpoint directory: (its step, whether the per-rank state was
        restored too, i.e. the mesh, precision and compressor are the ones it was saved with)."""
        meta = ck.read_meta(path)
        # zero: its stage lays out the units; error_feedback: whether there is memory to load
        keys = {"mesh": 0, "compress": 0, "precision": 0, "zero": 0, "error_feedback": "on",
                "zero_shard_group": ""}
        saved = {k: meta.get(k, d) for k, d in keys.items()}
        if isinstance(saved["mesh"], dict):  # written before --cp existed: cp 1
            saved["mesh"] = {"cp": 1, **saved["mesh"]}
        same = saved == {k: self.meta()[k] for k in keys}
        saved_zero = meta.get("zero", 0)
        if bool(saved_zero) != bool(self.cfg.zero):
            raise ConfigError(f"--resume: {path} was written with --zero {saved_zero}, this run "
                              f"has --zero {self.cfg.zero}: ZeRO checkpoints hold flat shards "
                              "by FQN, the others whole tensors; resume with zero on or off "
                              "as saved (any --zero stage and --dp load a ZeRO checkpoint)")
        if self.diloco is not None:  # replica K resumes replica K mod R_saved's local state
            outer_meta = outer.saved_meta(path)
            pend = outer_meta["pending"]["fragment"] if outer_meta["pending"] else None
            saved_r = meta.get("config", {}).get("replicas", 1)
            state = self.state(same, self.mesh.replica_rank % saved_r, pend)
        else:
            state = self.state(full=same)
        # --diloco: the local model and optimizer state of replica K sit under its own key
        key = (outer.replica_key(self.mesh.replica_rank % saved_r) if self.diloco is not None
               else None)
        local = state if key is None else state[key]
        if self.zero is not None:  # what the checkpoint holds, in this world's shards
            local.update(zck.load_target(path, self.zero, self.opt))
        ck.load(state, path)
        if self.zero is not None:
            zck.set_state_dict(self.zero, self.opt, local)
        train = ck.unblob(state["train"])
        self.sched.load_state_dict(train["sched"])
        for g, lr in zip(self.opt.param_groups, train["lrs"]):
            g["lr"] = lr
        self.batches.load_state_dict(train["data"])
        self.split_note = rebalance.restore(self, train.get("batch_split"))  # auto's split
        self.skips = train["skips"]
        if self.scaler is not None and train["scaler"]:
            self.scaler.load_state_dict(train["scaler"])
        if self.diloco is not None:
            outer.load(self, state, outer_meta,
                       ck.unblob(state[f"rank{dist.get_rank()}"]) if same else None)
        if same:
            mine = ck.unblob(state[f"rank{dist.get_rank()}"])
            torch.set_rng_state(mine["rng"])
            if self.dp is not None and mine["comm"] is not None:
                self.dp.load_compression_state_dict(mine["comm"])
            if self.zero is not None and mine["comm"] is not None:
                self.zero.compressor.load_state_dict(mine["comm"]["state"])
                if self.zero.replicas is not None:
                    self.zero.replicas.compressor.load_state_dict(mine["comm"]["replica"])
        return meta["step"], same

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.close()
        if self.dp is not None:
            self.dp.close()
        if self.zero is not None:
            self.zero.close()
        if self.ft is not None:  # after the DataParallel that reduces through it
            self.replicas.close()
