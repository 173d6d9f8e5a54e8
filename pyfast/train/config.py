"""The main job's flags, and every check that can run before any rank does work.

Checks are plain functions of the flags and the world size, so the launcher runs them before it
starts torchrun, and every rank runs the same ones (and gets the same answer) when the job is
started under torchrun directly.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from dataclasses import dataclass

from . import batch_split, ckpt_async, elastic, ft, offload, pp_balance, profile

PRECISIONS = ("fp32", "bf16", "fp16")
# pyfast.parallel.context's METHODS and LAYOUTS, here so that parsing the flags imports no torch
# (tests/test_train_config.py checks they are the same)
CP_METHODS = ("ring", "ulysses")
CP_LAYOUTS = ("zigzag", "contiguous")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


class ConfigError(ValueError):
    """A flag combination the job cannot run; the message names the flags and numbers."""


@dataclass
class TrainConfig:
    model: str = "gpt-small"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1                     # context parallelism: ranks sharing each sequence
    cp_method: str = "ring"         # ring or ulysses attention over the cp ranks
    cp_layout: str = "zigzag"       # which tokens a cp rank holds: zigzag or contiguous
    sequence_parallel: bool = False  # tp > 1: the residual stream sharded over tp (Megatron SP)
    compress: str = "none"
    error_feedback: str = "on"      # on: lossy compressors keep error-feedback memory; off: none
    bucket_mb: float = 0.0          # DataParallel's gradient bucket size in MB; 0: its default
    zero: int = 0                   # ZeRO stage 1-3 over dp instead of DataParallel; 0: off
    param_compress: str = "none"    # --zero 3: the parameter all-gather's compressor
    zero_shard_group: str = ""      # --zero: "node" or N (hybrid sharding); "": all dp x cp
    offload: str = "none"           # --zero: none, optimizer, params (pyfast.train.offload)
    offload_prefetch: int = 1
    offload_delay: bool = False
    schedule: str = "1f1b"
    micro_batches: int = 0          # 0: 1 without pipeline, 2 x pp with one
    grad_accum: int = 1
    precision: str = "fp32"
    activation_checkpointing: bool = False
    steps: int = 100
    batch: int = 8                  # global batch in sequences per optimizer step
    seq: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1       # cosine decays to lr * this
    warmup: int = -1                # -1: 10% of the steps
    lr_decay_steps: int = 0         # the step the cosine reaches its floor (0: --steps)
    weight_decay: float = 0.1
    clip: float = 1.0               # 0: no clipping
    seed: int = 0
    out: str = "runs/train"
    resume: bool = False
    ckpt_every: int = 0             # 0: only at the end
    eval_every: int = 0             # 0: only at the end
    eval_batches: int = 4
    data: str | None = None
    positions: str = "rotary"
    tie_embeddings: bool = False
    timeout: float = 300.0          # seconds a collective may wait for a silent peer
    # run safety (resume, checkpoints): see RESUME_FREE below
    keep_last: int = 0              # keep this many complete checkpoints; 0: all
    allow_change: str = ""          # comma list of recorded flags --resume may change: steps
    # watching a run (tensorboard.py, sample.py); check_watch
    tensorboard: str = "auto"       # auto: on when the tensorboard package imports; on; off
    plot: bool = True               # OUT/curves.png at the end (matplotlib: ~0.6 s on rank 0)
    sample_every: int = 0           # print and log a sample every K steps; 0: never
    prompt: str = ""                # the text the samples continue
    sample_tokens: int = 64         # tokens generated per sample
    sample_top_k: int = 0           # 0: greedy; K: draw from the K most likely tokens
    # DiLoCo over replicas of the mesh (pyfast.parallel.DiLoCo); check_diloco
    diloco: int = 0                 # H: inner steps per outer step (per fragment); 0: off
    replicas: int = 1               # R copies of the dp x cp x tp x pp mesh
    fragments: int = 1              # Streaming DiLoCo: F fragments synchronized staggered
    diloco_delay: int = 0           # tau: inner steps an outer all-reduce overlaps
    outer_compress: str = "none"    # the outer all-reduce's compressor spec
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    diloco_alpha: float = 0.0       # mixing of local and global parameters (0: take global)
    eval_outer: bool = False        # validate the outer (global) parameters too: val_loss_outer
    # LoRA fine-tuning (pyfast.models.lora, peft); check_lora
    lora: int = 0                   # adapter rank R; 0: a full fine-tune (every weight trains)
    lora_alpha: float | None = None  # the update's scale is alpha / R; None: 2 R
    lora_targets: str = "all-linear"  # all-linear or module names: q_proj,v_proj,...
    lora_dropout: float = 0.0
    base_dtype: str = "none"        # the frozen base's storage: none (as built), bf16, int8, nf4
    base_placement: str = "auto"    # --zero 3: auto, replicate (whole on every rank) or shard
    loss_chunks: int = 0            # K: the LM head and loss in K checkpointed chunks; 0: off
    # elastic restarts (pyfast.train.elastic): dp and grad_accum re-planned for the world
    elastic: bool = False
    # cheap checkpoints (pyfast.train.ckpt_async)
    ckpt_async: bool = False        # DCP async_save in a background thread (at most one)
    # per-step fault tolerance through torchft (pyfast.train.ft)
    ft: bool = False                # this job is one replica group of a torchft run
    lighthouse: str = ""            # HOST:PORT of torchft_lighthouse
    replica_id: int = -1            # this group's id (required with --ft)
    min_replicas: int = 1           # the fewest groups a step commits with
    ft_timeout: float = 30.0        # seconds a silent peer group is waited for
    # speed-weighted pipeline stages (pyfast.train.pp_balance)
    pp_balance: str = "even"        # even, auto (a probe at start) or C0,C1,... per pp rank
    # where a step goes (pyfast.train.profile)
    profile: str = ""               # START:END: torch.profiler over steps START..END-1; "": off
    # mixed hardware: samples per dp rank (pyfast.train.batch_split)
    batch_split: str = ""           # "N,N,...": rank r's rows of each global batch; "": even
    batch_split_every: int = 10     # auto: steps per measurement window (pyfast.train.rebalance)

    @property
    def m(self) -> int:
        return self.micro_batches or (1 if self.pp == 1 else 2 * self.pp)

    @property
    def virtual_stages(self) -> int:
        return 2 if self.schedule == "interleaved-1f1b" else 1

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup >= 0 else max(1, self.steps // 10)

    def model_key(self) -> dict:
        """What a checkpoint must match to be this model."""
        return {"model": self.model, "seq": self.seq, "positions": self.positions,
                "tie_embeddings": self.tie_embeddings, "data": self.data}

    @property
    def ranks(self) -> int:
        return self.replicas * self.dp * self.cp * self.tp * self.pp

    def mesh_flags(self) -> str:
        """'--dp 2 x --tp 1 x --pp 1' (with --cp when it is > 1, --replicas first when > 1):
        the mesh, as flags."""
        cp = f" x --cp {self.cp}" if self.cp > 1 else ""
        rep = f"--replicas {self.replicas} x " if self.replicas > 1 else ""
        return f"{rep}--dp {self.dp}{cp} x --tp {self.tp} x --pp {self.pp}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="pyfast train", description="Train a model on a dp x cp x "
                                "tp x pp mesh of processes (gloo on CPU, NCCL on GPUs).")
    a = p.add_argument
    g = p.add_argument_group("launch (torchrun's own meaning; omit under torchrun)")
    g.add_argument("--nproc", type=int, default=0, help="local ranks to start through torchrun")
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--node-rank", type=int, default=0)
    g.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of node 0 (several nodes)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="restart the ranks this often after a failure, resuming from the "
                        "latest checkpoint")
    g.add_argument("--print-launch", action="store_true", help="print the torchrun command "
                   "of every node and exit")
    g.add_argument("--start-method", choices=("forkserver", "exec"), default="forkserver",
                   help="how a rank starts: forked from a server that imported torch once "
                        "(default), or a fresh python per rank as torchrun's command does")
    a("--model", default=d.model, help="gpt-tiny, gpt-small, hf-llama-tiny, or the GPT at any "
      "shape: gpt:layers=L,heads=H,hidden=D[,mlp=R], or hf:DIR (a local Hugging Face model "
      "directory: config.json [+ *.safetensors])")
    a("--dp", type=int, default=d.dp)
    a("--tp", type=int, default=d.tp)
    a("--pp", type=int, default=d.pp)
    a("--cp", type=int, default=d.cp, help="context parallelism: shard every sequence over this "
      "many ranks (attention over the whole sequence by --cp-method)")
    a("--cp-method", default=d.cp_method, choices=CP_METHODS,
      help="ring: key/value blocks travel around the cp ranks (any head count); ulysses: "
           "all-to-alls between sequence and head shards (heads per tp rank divisible by --cp)")
    a("--cp-layout", default=d.cp_layout, choices=CP_LAYOUTS,
      help="zigzag: rank r holds chunks r and 2cp-1-r of 2cp (balanced causal work; --seq "
           "divisible by 2 x cp); contiguous: chunk r of cp")
    a("--sequence-parallel", action="store_true", help="with --tp > 1: shard the activations "
      "between the tp matmuls (norms, residual stream) along the sequence over the tp ranks "
      "(Megatron's sequence parallelism): 1/tp of their memory; all-gather + reduce-scatter "
      "instead of each all-reduce (docs/training.md)")
    a("--compress", default=d.compress, help="gradient compressor spec over dp (int8, topk:0.01, "
      "..., auto); error feedback for lossy ones")
    a("--error-feedback", default=d.error_feedback, choices=("on", "off"),
      help="error-feedback memory for lossy --compress specs (default on)")
    a("--bucket-mb", type=float, default=d.bucket_mb,
      help="DataParallel gradient bucket size in MB (default 0: DataParallel's own)")
    a("--zero", type=int, default=d.zero, choices=(0, 1, 2, 3),
      help="shard over dp with pyfast.parallel.zero: 1 optimizer state, 2 + gradients, "
           "3 + parameters (default 0: DataParallel); --compress compresses its gradient "
           "reduce-scatter")
    a("--zero-shard-group", default=d.zero_shard_group, metavar="node|N",
      help="--zero: shard over N consecutive dp x cp ranks (node: those on this node, "
           "LOCAL_WORLD_SIZE) and replicate across the groups (hybrid sharding, HSDP); "
           "--compress then compresses the cross-group all-reduce of each shard and the "
           "reduce-scatter inside the group is exact (default: the whole dp x cp group)")
    a("--param-compress", default=d.param_compress,
      help="--zero 3: compressor of the parameter all-gather (bf16, fp16, int8, fp8; the "
           "fp32 master shards stay exact)")
    a("--schedule", default=d.schedule, choices=SCHEDULES)
    a("--micro-batches", type=int, default=d.micro_batches,
      help="pieces per accumulation step (pipelined when pp > 1); default 1, or 2 x pp")
    a("--grad-accum", type=int, default=d.grad_accum)
    a("--precision", default=d.precision, choices=PRECISIONS,
      help="bf16/fp16: autocast with fp32 master weights; fp16 adds a GradScaler")
    a("--activation-checkpointing", action="store_true")
    a("--loss-chunks", type=int, default=d.loss_chunks, metavar="K",
      help="run the LM head and the fp32 cross-entropy on K chunks of the tokens, each "
           "recomputed in backward, so no step keeps the whole [tokens, vocab] logits "
           "(default 0: off)")
    a("--steps", type=int, default=d.steps)
    a("--batch", type=int, default=d.batch, help="global batch: sequences per optimizer step")
    a("--seq", type=int, default=d.seq)
    a("--lr", type=float, default=d.lr)
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    a("--warmup", type=int, default=d.warmup, help="warm-up steps (default 10%% of --steps)")
    a("--lr-decay-steps", type=int, default=d.lr_decay_steps, metavar="S",
      help="the cosine reaches lr x min-lr-ratio at step S and stays there (nanoGPT's "
           "lr_decay_iters; default 0: --steps), so runs of different lengths can share one "
           "schedule")
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--clip", type=float, default=d.clip, help="global gradient-norm clip (0: off)")
    a("--seed", type=int, default=d.seed)
    a("--out", default=d.out)
    a("--resume", action="store_true", help="continue from the latest complete checkpoint")
    a("--ckpt-every", type=int, default=d.ckpt_every)
    a("--eval-every", type=int, default=d.eval_every)
    a("--eval-batches", type=int, default=d.eval_batches)
    a("--data", default=None, help="a folder from `pyfast data prepare`, a text file, folder or "
      "nanoGPT uint16 .bin (default: the Python standard library's sources)")
    a("--positions", default=d.positions, choices=("rotary", "learned"))
    a("--tie-embeddings", action="store_true")
    a("--timeout", type=float, default=d.timeout)
    # run safety: checkpoint rotation and what a resumed run may change
    a("--keep-last", type=int, default=d.keep_last, help="keep only the N latest complete "
      "checkpoints, deleting older ones once a newer one is complete (default 0: keep all)")
    a("--allow-change", default=d.allow_change, metavar="FLAGS",
      help="--resume: let these recorded flags differ from the checkpoint's run (comma list; "
           f"{', '.join(RESUME_ALLOWABLE)}: extend a run); logged")
    add_watch_flags(p, d)
    add_diloco_flags(p, d)
    add_lora_flags(p, d)
    offload.add_flags(p, d)
    elastic.add_flags(p, d)
    ckpt_async.add_flags(p, d)
    ft.add_flags(p, d)
    pp_balance.add_flags(p, d)
    profile.add_flags(p, d)
    batch_split.add_flags(p, d)
    g = p.add_argument_group("dry run (pyfast.train.dryrun: no process is started)")
    g.add_argument("--dry-run", action="store_true", help="run one whole step of the job for a "
                   "world of --nproc ranks in this process, on memoryless (meta) tensors over "
                   "torch's fake process group, and print each rank's peak memory by kind")
    g.add_argument("--dry-rank", default="roles", help="which ranks: 'roles' (default: one per "
                   "distinct role: each pipeline stage and, with --zero, each dp x cp shard, at "
                   "tp/cp/dp rank 0 otherwise, whose ranks hold the same shapes), 'all', or "
                   "R[,R...]")
    g.add_argument("--gpu", default=None, help="size the peak against this GPU's memory: "
                   "h100, h200, a100-80gb, a100-40gb, l40s, l4, a10g, v100-32gb, v100-16gb")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the "
                   "table: {\"ranks\": [{\"rank\", \"peak_bytes\", \"parameters\", ...}]}")
    return p


LAUNCH_FLAGS = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "max_restarts", "print_launch",
                "start_method")
DRY_FLAGS = ("dry_run", "dry_rank", "gpu", "json")


def from_args(ns: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{k: v for k, v in vars(ns).items()
                          if k not in LAUNCH_FLAGS + DRY_FLAGS})


def plan_world(cfg: TrainConfig, world: int) -> TrainConfig:
    """cfg as it runs on `world` ranks: with --elastic, dp and grad_accum re-planned for the
    world (pyfast.train.elastic.plan); ConfigError naming the numbers when it cannot be."""
    planned = elastic.plan(cfg, world)
    if isinstance(planned, str):
        raise ConfigError(planned)
    return planned


def check(cfg: TrainConfig, world: int, model: bool = True) -> dict:
    """ConfigError naming the first problem: everything knowable from the flags alone
    (model=False: all but the model's own limits, which check_model tells). Returns the data's
    fingerprint (check_data), which resume and the checkpoints' record use."""
    check_degrees(cfg)
    for name in ("steps", "batch", "seq", "grad_accum", "eval_batches"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    for name in ("micro_batches", "ckpt_every", "eval_every", "keep_last"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if cfg.ranks != world:
        raise ConfigError(f"{cfg.mesh_flags()} = {cfg.ranks} ranks, but the world size is {world}")
    if batch_split.problem(cfg):  # --batch-split: its own rule for --batch (pyfast.train.batch_split)
        raise ConfigError(batch_split.problem(cfg))
    per = cfg.replicas * cfg.dp * cfg.grad_accum * cfg.m
    if cfg.batch % per and not cfg.batch_split:
        rep = f"replicas {cfg.replicas} x " if cfg.replicas > 1 else ""
        raise ConfigError(f"--batch {cfg.batch} is not divisible by {rep}dp {cfg.dp} x "
                          f"grad-accum {cfg.grad_accum} x micro-batches {cfg.m} = {per}")
    if cfg.lr_decay_steps < 0:
        raise ConfigError(f"--lr-decay-steps must be >= 0 (0: --steps), got {cfg.lr_decay_steps}")
    if cfg.lr <= 0 or cfg.clip < 0 or not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"need --lr > 0, --clip >= 0 and 0 <= --min-lr-ratio <= 1; got lr "
                          f"{cfg.lr}, clip {cfg.clip}, min-lr-ratio {cfg.min_lr_ratio}")
    import pyfast.compress as C
    try:
        C.get("fp16" if cfg.compress == "auto" else cfg.compress)
    except ValueError as e:
        raise ConfigError(f"--compress {cfg.compress!r}: {e}") from None
    if cfg.bucket_mb < 0:
        raise ConfigError(f"--bucket-mb must be > 0 (0: DataParallel's default), got {cfg.bucket_mb}")
    if cfg.compress not in ("none", "") and cfg.dp * cfg.cp == 1 and not cfg.ft:
        raise ConfigError(f"--compress {cfg.compress} compresses the data-parallel gradient "
                          "reduction, but --dp is 1 (nothing to reduce)")
    unknown = {f.strip() for f in cfg.allow_change.split(",") if f.strip()} - \
        set(RESUME_ALLOWABLE)
    if unknown:
        raise ConfigError(f"--allow-change {cfg.allow_change}: only "
                          f"{', '.join(RESUME_ALLOWABLE)} may be allowed to change on --resume "
                          f"(not {', '.join(sorted(unknown))})")
    check_loss_chunks(cfg)
    check_cp(cfg)
    check_zero(cfg)
    if offload.problem(cfg):
        raise ConfigError(offload.problem(cfg))
    if elastic.problem(cfg):
        raise ConfigError(elastic.problem(cfg))
    if ft.problem(cfg):  # --ft and its flags (pyfast.train.ft)
        raise ConfigError(ft.problem(cfg))
    if pp_balance.problem(cfg):  # --pp-balance (pyfast.train.pp_balance)
        raise ConfigError(pp_balance.problem(cfg))
    if profile.problem(cfg):  # --profile (pyfast.train.profile)
        raise ConfigError(profile.problem(cfg))
    check_diloco(cfg)
    check_lora(cfg)
    data = check_data(cfg)
    check_watch(cfg)
    check_model_vocab(cfg, data)
    if model:
        check_model(cfg)
    return data


# --resume compares the checkpoint's record of its run with this one, field by field. What may
# differ (logged): the mesh and how ranks split their work (DCP reshards; per-rank RNG and
# error-feedback memory are then left out), the eval/checkpoint cadence, where and how the job
# runs. With --allow-change: RESUME_ALLOWABLE. Refused: everything else (model, data, lr and its
# schedule, optimizer, precision, compressor and its feedback, bucket size, seed, ...); --warmup
# is compared resolved (its default follows --steps), --data by its fingerprint, --zero on/off
# (ZeRO checkpoints hold flat shards) while its stage may change.
RESUME_FREE = ("dp", "tp", "pp", "cp", "cp_method", "cp_layout", "sequence_parallel",
               "schedule", "micro_batches", "grad_accum", "activation_checkpointing", "ckpt_every", "eval_every",
               "eval_batches", "timeout", "out", "resume", "keep_last", "allow_change", "data")
RESUME_ALLOWABLE = ("steps",)
# what is watched changes nothing in the run: free on --resume too
RESUME_FREE += ("tensorboard", "plot", "sample_every", "prompt", "sample_tokens", "sample_top_k")
# DiLoCo's global parameters and outer state are the same on every replica: --replicas may change
RESUME_FREE += ("replicas",)
# --ft: where the lighthouse is and how the groups meet change nothing a checkpoint holds
RESUME_FREE += ("ft", "lighthouse", "replica_id", "min_replicas", "ft_timeout")
# where a --zero 3 LoRA base lives changes no value (replicated and sharded bases run the same
# bytes: tests/test_zero_frozen.py) and the checkpoints hold no frozen parameter either way
RESUME_FREE += ("base_placement",)
# --loss-chunks computes the same mean loss (to fp32 rounding: tests/test_loss_chunks.py)
RESUME_FREE += ("loss_chunks",)
# --eval-outer only adds a validation of the outer parameters: the run is the same
RESUME_FREE += ("eval_outer",)
# the shard group changes where the shards live, as --dp does (DCP reshards); the per-rank
# error-feedback memory is then left out (Job.load compares it)
RESUME_FREE += ("zero_shard_group",)
# --profile only watches the run: its trace and split change nothing a checkpoint holds
RESUME_FREE += ("profile",)
# offloaded state is saved as if it were on the device (tests/test_zero_offload.py); the delayed
# update (--offload-delay) is another update rule: refused as an optimizer change is
RESUME_FREE += ("offload", "offload_prefetch")
# --batch-split changes which rank takes which rows of the same global batches, not the update
RESUME_FREE += ("batch_split", "batch_split_every")
# --elastic re-plans dp and grad_accum (both free above) and resumes: the run is the same
RESUME_FREE += ("elastic",)
# how a checkpoint is written changes nothing in it (tests/test_ckpt_async.py: bit-identical)
RESUME_FREE += ("ckpt_async",)
# --pp-balance moves layers between stages as --pp does (the checkpoints hold them by FQN)
RESUME_FREE += ("pp_balance",)


def resume_changes(cfg: TrainConfig, record: dict, data: dict | None = None
                   ) -> tuple[list[str], list[str]]:
    """(refused, allowed) differences between this run and a checkpoint's `record` (its
    "config", "warmup_steps" and "data" fingerprint), each as '--flag: X in the checkpoint,
    Y here'. `data`: this run's fingerprint (pyfast.data.check); None skips that comparison."""
    saved, mine = dict(record["config"]), dataclasses.asdict(cfg)
    saved["warmup"], mine["warmup"] = record.get("warmup_steps"), cfg.warmup_steps
    allowed = {f.strip() for f in cfg.allow_change.split(",") if f.strip()}
    refused, changed = [], []
    for k in mine:
        if k not in saved or saved[k] == mine[k] or k in ("resume", "allow_change"):
            continue
        shown = {w: ("2 R (its default)" if k == "lora_alpha" and v is None else v)
                 for w, v in (("saved", saved[k]), ("mine", mine[k]))}
        what = (f"--{k.replace('_', '-')}: {shown['saved']} in the checkpoint, {shown['mine']} "
                "here")
        if k == "zero" and bool(saved[k]) != bool(mine[k]):
            refused.append(what + " (ZeRO checkpoints hold flat shards by FQN, the others whole "
                           "tensors: resume with zero on or off as saved)")
        elif k == "warmup" and cfg.warmup < 0:
            refused.append(what + f" (resolved from --steps; pass --warmup {saved[k]})")
        elif k in LORA_RESUME:
            why = lora_resume_hint(k, saved, mine)
            if why:
                refused.append(what + why)
        elif k in RESUME_FREE or k == "zero" or k in allowed:
            changed.append(what)
        else:
            hint = " (pass --allow-change steps to extend the run)" if k == "steps" else ""
            refused.append(what + hint)
    if data is not None and record.get("data") is not None and record["data"] != data:
        def fp(path, d):
            return (f"{path or 'the stdlib sources'} ({d['train']:,} training {d['unit']}, "
                    f"blake2b {d['blake2b'][:12]}"
                    + (f", tokenizer {d['tokenizer'][:28]}" if "tokenizer" in d else "") + ")")
        refused.append(f"--data: {fp(saved.get('data'), record['data'])} in the checkpoint, "
                       f"{fp(cfg.data, data)} here")
    return refused, changed


LORA_RESUME = ("lora", "lora_alpha", "lora_targets", "lora_dropout", "base_dtype")
# (--base-placement is free: RESUME_FREE)


def lora_resume_hint(k: str, saved: dict, mine: dict) -> str:
    """Why a LoRA flag may not change on --resume (resume_changes); "" when the change is none
    (no --lora-alpha means 2 R: it and an explicit 2 R are the same run)."""
    r0, r1 = saved.get("lora", 0), mine["lora"]
    if k == "lora":
        if not r1:
            return (" (the checkpoint holds LoRA adapters and their optimizer state only, on a "
                    "frozen base it does not store: a full fine-tune cannot resume from it; "
                    f"resume with --lora {r0}, or start a fresh full fine-tune)")
        if not r0:
            return (" (a full fine-tune's checkpoint: every weight trained, no adapters to "
                    f"resume; continue it without --lora, or start a fresh --lora {r1} run "
                    "under another --out)")
        return (f" (adapters of rank {r0} are [{r0} x features] tensors: rank {r1} is another "
                f"set of adapters; resume with --lora {r0})")
    if not r0 and not r1:
        return ""  # LoRA off in both: the LoRA flags' values mean nothing (check_lora)
    if k == "lora_alpha":
        a0, a1 = saved[k] or 2.0 * r0, mine[k] or 2.0 * r1
        return "" if a0 == a1 else (f" (alpha / rank scales every adapter update: the "
                                    f"adapters trained at scale {a0 / r0:g} would mean "
                                    f"another update at {a1 / r1:g}; resume with "
                                    f"--lora-alpha {a0:g})")
    if k == "lora_targets":
        return (" (the checkpoint's adapters sit on other modules than these flags would put "
                f"them on; resume with --lora-targets {saved[k]})")
    if k == "base_dtype":
        return (" (the frozen base is not in the checkpoint: a resume rebuilds it, and in "
                "another --base-dtype it is another base under the same adapters; resume "
                f"with --base-dtype {saved[k]})")
    return f" (resume with --{k.replace('_', '-')} {saved[k]})"


def add_watch_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("watching a run (TensorBoard, samples)")
    g.add_argument("--tensorboard", nargs="?", const="on", default=d.tensorboard,
                   choices=("auto", "on", "off"), help="write TensorBoard event files to "
                   "OUT/tb (default auto: when the tensorboard package is installed)")
    g.add_argument("--no-tensorboard", dest="tensorboard", action="store_const", const="off")
    g.add_argument("--plot", action=argparse.BooleanOptionalAction, default=d.plot,
                   help="draw OUT/curves.png at the end (default on; matplotlib's import and "
                        "drawing took ~0.6 s of rank 0 on a 2-core CPU, which a short or "
                        "scripted run may not want)")
    g.add_argument("--sample-every", type=int, default=d.sample_every, metavar="K",
                   help="every K steps and at the end, rank 0 prints and logs a sample of "
                        "--sample-tokens continuing --prompt (default 0: never)")
    g.add_argument("--prompt", default=d.prompt, help="the text samples continue, encoded "
                   "by the data's tokenizer (DATA_DIR/tokenizer.json, else bytes)")
    g.add_argument("--sample-tokens", type=int, default=d.sample_tokens)
    g.add_argument("--sample-top-k", type=int, default=d.sample_top_k, metavar="K",
                   help="draw each token from the K most likely (default 0: greedy)")


def check_watch(cfg: TrainConfig) -> None:
    """--tensorboard and the sampling flags: the package, the prompt and its tokenizer."""
    from .tensorboard import available
    if cfg.tensorboard not in ("auto", "on", "off"):
        raise ConfigError(f"--tensorboard must be auto, on or off, got {cfg.tensorboard!r}")
    if cfg.tensorboard == "on" and not available():
        raise ConfigError("--tensorboard: the tensorboard package is not installed (pip "
                          "install 'pyfast[tb]'); pass --no-tensorboard to train without it")
    if cfg.sample_every < 0 or cfg.sample_top_k < 0 or cfg.sample_tokens < 1:
        raise ConfigError(f"need --sample-every >= 0, --sample-top-k >= 0 and --sample-tokens "
                          f">= 1; got {cfg.sample_every}, {cfg.sample_top_k}, "
                          f"{cfg.sample_tokens}")
    if not cfg.sample_every:
        if cfg.prompt:
            raise ConfigError("--prompt without --sample-every K: nothing would be sampled "
                              "(pass --sample-every K to sample every K steps)")
        return
    if not cfg.prompt:
        raise ConfigError(f"--sample-every {cfg.sample_every} needs --prompt TEXT: the text "
                          "the samples continue")
    from .sample import tokenizer_for
    try:
        tok = tokenizer_for(cfg.data)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--sample-every: {e}") from None
    n = len(tok.encode(cfg.prompt))
    if n == 0:
        raise ConfigError(f"--prompt {cfg.prompt!r} encodes to no tokens with {tok.name}")
    if n > cfg.seq:
        raise ConfigError(f"--prompt encodes to {n} tokens with {tok.name}, more than --seq "
                          f"{cfg.seq} (the longest sequence the model reads)")


def check_data(cfg: TrainConfig) -> dict:
    """--data against --batch and --seq before any rank starts (pyfast.data.check); returns
    the corpus's fingerprint."""
    from pyfast.data import check as data_check
    try:
        return data_check(cfg.data, cfg.batch, cfg.seq)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--data {cfg.data or '(default: the stdlib sources)'}: {e}") from None


def check_model_vocab(cfg: TrainConfig, data: dict) -> None:
    """--model hf:DIR has its own vocabulary (config.json's vocab_size): refuse data whose
    vocabulary is larger (its ids past the embedding would have no row). The data's vocabulary:
    its fingerprint's "vocab_size" (prepared datasets), 256 for text read as bytes, else
    load_corpus's (a uint16 .bin: one pass over its tokens)."""
    if not cfg.model.startswith("hf:"):
        return
    from pyfast.models.hf import vocab_size
    try:
        model_vocab = vocab_size(cfg.model[len("hf:"):])
    except ValueError as e:
        raise ConfigError(f"--model {e}") from None
    data_vocab = data.get("vocab_size") if isinstance(data, dict) else None
    if data_vocab is None and isinstance(data, dict) and data.get("unit") == "bytes":
        data_vocab = 256  # text read as bytes: load_corpus's vocabulary, without reading it
    if data_vocab is None:
        from pyfast.data import load_corpus
        data_vocab = load_corpus(cfg.data).vocab_size
    if data_vocab > model_vocab:
        raise ConfigError(f"--data {cfg.data or '(default: the stdlib sources)'} has a vocabulary"
                          f" of {data_vocab} tokens, more than the {model_vocab} rows of "
                          f"--model {cfg.model}'s embedding (config.json's vocab_size): use "
                          "data tokenized for this model")


def check_loss_chunks(cfg: TrainConfig) -> None:
    """--loss-chunks K (Job.chunked_loss): K >= 0, and not where the job's loss does not see the
    whole head's output on one rank."""
    k = cfg.loss_chunks
    if k < 0:
        raise ConfigError(f"--loss-chunks must be >= 0 (0: off), got {k}")
    if k and cfg.pp > 1:
        raise ConfigError(f"--loss-chunks {k} with --pp {cfg.pp}: the pipeline's last stage "
                          "computes the loss from the logits its own layers return (Pipeline's "
                          "loss_fn), so the head cannot be split from them; use --pp 1")
    if k and cfg.tp > 1:
        raise ConfigError(f"--loss-chunks {k} with --tp {cfg.tp}: the head's logits are "
                          "vocabulary-parallel under tp (vocab_parallel_cross_entropy's mean "
                          "over the whole piece), not chunked yet; use --tp 1 (e.g. --zero 3)")


def check_degrees(cfg: TrainConfig) -> None:
    """The mesh's degrees are >= 1 (the launcher sizes the job by them, before check)."""
    for name in ("replicas", "dp", "cp", "tp", "pp"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(cfg, name)}")


def check_cp(cfg: TrainConfig) -> None:
    """--cp / --cp-method / --cp-layout against the other flags (the heads: check_model)."""
    from pyfast.parallel.context import length_problem, n_chunks
    if cfg.cp_method not in CP_METHODS or cfg.cp_layout not in CP_LAYOUTS:
        raise ConfigError(f"--cp-method must be one of {', '.join(CP_METHODS)} and --cp-layout "
                          f"one of {', '.join(CP_LAYOUTS)}; got {cfg.cp_method}, {cfg.cp_layout}")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("--sequence-parallel shards activations over the tensor-parallel "
                          "ranks: it needs --tp > 1 (got --tp 1)")
    if cfg.sequence_parallel and (cfg.seq // max(cfg.cp, 1)) % cfg.tp:
        raise ConfigError(f"--sequence-parallel: each rank's {cfg.seq // cfg.cp} tokens of a "
                          f"sequence (--seq {cfg.seq} / --cp {cfg.cp}) are not divisible by "
                          f"--tp {cfg.tp}")
    if cfg.cp == 1:
        return
    if length_problem(cfg.seq, cfg.cp, cfg.cp_layout):
        n = n_chunks(cfg.cp, cfg.cp_layout)
        by = f"2 x --cp {cfg.cp}" if cfg.cp_layout == "zigzag" else f"--cp {cfg.cp}"
        raise ConfigError(f"--seq {cfg.seq} is not divisible by {n} ({by}, --cp-layout "
                          f"{cfg.cp_layout}): every cp rank holds equal chunks of each sequence")


def check_zero(cfg: TrainConfig) -> None:
    """--zero / --param-compress against the other flags (zero()'s own rules, told by flag)."""
    if cfg.param_compress not in ("none", "") and cfg.zero != 3:
        raise ConfigError(f"--param-compress {cfg.param_compress} compresses stage 3's parameter "
                          f"all-gather: it needs --zero 3 (got --zero {cfg.zero})")
    if cfg.zero_shard_group and not cfg.zero:
        raise ConfigError(f"--zero-shard-group {cfg.zero_shard_group} chooses the ranks ZeRO "
                          "shards over: it needs --zero 1, 2 or 3")
    if not cfg.zero:
        return
    check_shard_group(cfg)
    if cfg.zero_shard_group and cfg.precision == "fp16" and cfg.compress not in ("none", "") \
            and cfg.error_feedback == "on":
        raise ConfigError(f"--zero-shard-group with --precision fp16 and --compress "
                          f"{cfg.compress}: the cross-node compressor's error-feedback memory is "
                          "not rolled back on a skipped (overflowing) step yet; use bf16, "
                          "--error-feedback off, or no --compress")
    if cfg.zero not in (1, 2, 3):
        raise ConfigError(f"--zero must be 1, 2 or 3 (0: off), got {cfg.zero}")
    if cfg.dp * cfg.cp == 1 and cfg.tp == cfg.pp == 1 and cfg.offload == "none":
        raise ConfigError(f"--zero {cfg.zero} shards over the data-parallel ranks, but --dp is 1 "
                          "(nothing to shard over; with --offload, one rank is ZeRO-Offload)")
    # --dp 1 (x --cp 1) with --tp / --pp > 1 is allowed: a shard group of one rank per tp / pp
    # shard, so a ZeRO checkpoint of a larger dp resumes there (docs/zero.md)
    if cfg.zero == 3 and cfg.pp > 1 and cfg.schedule == "zb-h1":
        raise ConfigError(f"--zero 3 with --schedule {cfg.schedule}: zero bubble splits backward "
                          "into input- and weight-gradient passes, and the weight pass runs after "
                          "stage 3 regathered and freed the layer, so it cannot regather per "
                          "micro-batch; use --zero 1 or 2, or --schedule 1f1b / gpipe / "
                          "interleaved-1f1b")
    import pyfast.compress as C
    from pyfast.parallel.zero import PARAM_COMPRESSORS
    if cfg.compress == "auto" or C.get(cfg.compress).algorithm == "powersgd":
        raise ConfigError(f"--compress {cfg.compress} with --zero {cfg.zero}: the gradient "
                          "reduce-scatter takes one fixed compressor that works on a shard "
                          "(e.g. int8), not auto or powersgd")
    if cfg.param_compress not in PARAM_COMPRESSORS:
        raise ConfigError(f"--param-compress {cfg.param_compress!r}: one of "
                          f"{', '.join(c for c in PARAM_COMPRESSORS if c)}")


def check_shard_group(cfg: TrainConfig, local_world: int | None = None) -> int | None:
    """--zero-shard-group as a shard size N (None: the whole dp x cp group, no hybrid). "node"
    needs local_world (LOCAL_WORLD_SIZE, the ranks on this node: torchrun and pyfast's
    launcher set it; None: checked later, on the ranks). Shard groups are N consecutive dp x
    cp ranks of one tp / pp coordinate (pyfast.parallel.mesh), N * tp consecutive ranks."""
    spec, dpcp = cfg.zero_shard_group, cfg.dp * cfg.cp
    if not spec:
        return None
    if spec == "node":
        if local_world is None:
            return None
        if local_world % cfg.tp:
            raise ConfigError(f"--zero-shard-group node: a node holds {local_world} ranks, not "
                              f"whole tp groups of --tp {cfg.tp}; give N")
        n = min(local_world // cfg.tp, dpcp)
        if dpcp % n:
            raise ConfigError(f"--zero-shard-group node: the {n} dp x cp ranks of a node "
                              f"({local_world} ranks / --tp {cfg.tp}) do not divide dp x cp = "
                              f"{dpcp}")
        return None if n == dpcp else n
    try:
        n = int(spec)
    except ValueError:
        raise ConfigError(f"--zero-shard-group must be 'node' or a number of ranks, got "
                          f"{spec!r}") from None
    if n < 1 or dpcp % n:
        raise ConfigError(f"--zero-shard-group {n}: must be >= 1 and divide dp x cp = "
                          f"{cfg.dp} x {cfg.cp} = {dpcp}")
    span = n * cfg.tp  # the global ranks one shard group spans
    if local_world and span % local_world and local_world % span:
        raise ConfigError(f"--zero-shard-group {n} with --tp {cfg.tp}: a shard group spans "
                          f"{span} consecutive ranks, which cross a node's boundary "
                          f"({local_world} ranks a node)")
    return None if n == dpcp else n


def build_model(cfg: TrainConfig, vocab_size: int, device=None):
    """models.build with the job's flags; ConfigError for an unknown model or bad options."""
    import torch

    from pyfast import models
    if not models.known(cfg.model):
        raise ConfigError(f"--model {cfg.model!r} is unknown; known: {', '.join(models.MODELS)}, "
                          "gpt:layers=L,heads=H,hidden=D[,mlp=R], hf:DIR")
    meta = device is not None and torch.device(device).type == "meta"
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext(), \
                _meta_build() if meta else contextlib.nullcontext():
            m = models.build(cfg.model, vocab_size, cfg.seq, positions=cfg.positions,
                             tie_embeddings=cfg.tie_embeddings)
            if cfg.lora:  # before the pipeline's cut: the stages hold the adapted modules
                from pyfast.models.lora import apply_lora
                try:
                    apply_lora(m, lora_options(cfg))
                except ValueError as e:  # a target that names no module (the options: check)
                    raise ConfigError(f"--lora-targets {cfg.lora_targets}: {e}") from None
                if cfg.base_dtype != "none":
                    from pyfast.models.quant_base import quantize_base
                    quantize_base(m, cfg.base_dtype)
            # an HF model is pipelined as its Sequential form (pyfast.models.hf_stages)
            return m.as_sequential() if cfg.pp > 1 and hasattr(m, "as_sequential") else m
    except ConfigError:
        raise
    except (ImportError, ValueError) as e:
        raise ConfigError(f"--model {cfg.model}: {e}") from None


def _meta_build():
    """A model built on meta without torch's Python references for meta tensors, whose first
    call imports torch._dynamo: 1.1 s of the launcher's model check (check_model) on the
    2-core VM, 0.5-0.85 s of a gpt-tiny launch's wall time (three launches each way,
    alternated). Random initialisation of a meta tensor is a no-op here (it holds no values
    either way); the GPT's RoPE tables are made on the CPU and moved (models.gpt.rotary_tables).
    A Hugging Face model's own code still computes on meta (its rotary inv_freq)."""
    import torch
    from torch.overrides import TorchFunctionMode
    T, init = torch.Tensor, torch.nn.init
    # nn.init's functions reach the mode before their own tensor calls, which it does not see
    # again while it handles the outer call
    random_ = {T.normal_, T.uniform_, T.random_, T.exponential_, T.bernoulli_, T.cauchy_,
               T.log_normal_, T.geometric_, init.normal_, init.uniform_, init.trunc_normal_,
               init.kaiming_uniform_, init.kaiming_normal_, init.xavier_uniform_,
               init.xavier_normal_, init.orthogonal_, init.sparse_}

    class MetaBuild(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            t = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if func in random_ and getattr(t, "is_meta", False):
                return t
            return func(*args, **kwargs)
    return MetaBuild()


def model_shape(m) -> tuple[int, int]:
    """(attention heads, transformer layers) of a GPT or a Hugging Face model (its config)."""
    if hasattr(m, "cfg"):
        return m.cfg.n_head, m.cfg.n_layer
    return m.config.num_attention_heads, m.config.num_hidden_layers


def check_model(cfg: TrainConfig, m=None) -> None:
    """The model's own limits, on `m` (default: the model built on the meta device: no
    memory, no init drawn; the launcher's check costs about 1 s of torch's meta machinery)."""
    from pyfast import models
    m = build_model(cfg, 256, "meta") if m is None else m
    check_fragments(cfg, m)
    if cfg.loss_chunks and not hasattr(m, "head_module"):
        raise ConfigError(f"--loss-chunks {cfg.loss_chunks}: --model {cfg.model} does not split "
                          "its LM head from the rest (forward(ids, hidden=True), head_module)")
    why = m.tp_check(cfg.tp)
    if why:
        raise ConfigError(f"--tp {cfg.tp}: {why}")
    if cfg.sequence_parallel:
        try:
            m.tp_plan(sequence_parallel=True)
        except (TypeError, ValueError) as e:  # TypeError: a tp_plan without the argument
            raise ConfigError(f"--sequence-parallel: --model {cfg.model} has no "
                              f"sequence-parallel plan ({e})") from None
    if cfg.cp > 1:
        if not hasattr(m, "context_parallel"):
            raise ConfigError(f"--cp {cfg.cp}: --model {cfg.model} has no context-parallel "
                              "attention (GPT.context_parallel); use --cp 1")
        why = m.cp_check() if hasattr(m, "cp_check") else None  # HF models: pyfast.models.hf
        if why:
            raise ConfigError(f"--cp {cfg.cp}: --model {cfg.model}: {why}")
        heads = model_shape(m)[0] // cfg.tp
        if cfg.cp_method == "ulysses" and heads % cfg.cp:
            raise ConfigError(f"--cp-method ulysses with --cp {cfg.cp}: each tp rank holds "
                              f"{heads} heads (n_head {model_shape(m)[0]} / --tp {cfg.tp}), not "
                              f"divisible by {cfg.cp}; use --cp-method ring")
    if cfg.pp > 1:
        if not models.pipelinable(m):
            raise ConfigError(f"--model {cfg.model} cannot be cut into pipeline stages (it is "
                              f"not an nn.Sequential); use --pp 1")
        layers = model_shape(m)[1]
        if cfg.pp > layers:
            raise ConfigError(f"--pp {cfg.pp}: more pipeline stages than the {layers} "
                              f"transformer layers of {cfg.model}")
        if cfg.tie_embeddings:
            raise ConfigError("--tie-embeddings with --pp > 1: the embedding and the LM head "
                              "would live on different stages (tied weights across stages are "
                              "not supported)")
        if cfg.virtual_stages * cfg.pp > layers + 2:
            raise ConfigError(f"--schedule {cfg.schedule} with --pp {cfg.pp}: "
                              f"{cfg.virtual_stages * cfg.pp} stages, more than the {layers + 2} "
                              f"modules of {cfg.model} (embedding, {layers} layers, head)")


def add_diloco_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("DiLoCo: replicas that synchronize every H steps "
                             "(pyfast.parallel.DiLoCo; docs/diloco.md)")
    g.add_argument("--diloco", type=int, default=d.diloco, metavar="H",
                   help="an outer step every H inner steps (default 0: off)")
    g.add_argument("--replicas", type=int, default=d.replicas, metavar="R",
                   help="R copies of the dp x cp x tp x pp mesh (world = R x dp x cp x tp x pp), "
                        "each an ordinary job; they meet only in DiLoCo's outer steps")
    g.add_argument("--fragments", type=int, default=d.fragments, metavar="F",
                   help="Streaming DiLoCo: F fragments, fragment f synced at offset f x H/F")
    g.add_argument("--diloco-delay", type=int, default=d.diloco_delay, metavar="TAU",
                   help="an outer all-reduce runs behind TAU inner steps (< H/F)")
    g.add_argument("--outer-compress", default=d.outer_compress, metavar="SPEC",
                   help="compressor of the outer gradients (int8, int4, ...; default none: fp32)")
    g.add_argument("--outer-lr", type=float, default=d.outer_lr)
    g.add_argument("--outer-momentum", type=float, default=d.outer_momentum)
    g.add_argument("--outer-nesterov", action=argparse.BooleanOptionalAction,
                   default=d.outer_nesterov)
    g.add_argument("--diloco-alpha", type=float, default=d.diloco_alpha, metavar="ALPHA",
                   help="after a sync, params = ALPHA x local + (1 - ALPHA) x global")
    g.add_argument("--eval-outer", action="store_true", default=d.eval_outer,
                   help="validate the outer (global) parameters as well as the replicas' own "
                        "(val_loss_outer beside val_loss)")


def check_diloco(cfg: TrainConfig) -> None:
    """--diloco and its flags against each other and the mesh (fragments against the model's
    parameter tensors: check_model)."""
    if cfg.diloco < 0:
        raise ConfigError(f"--diloco H: the inner steps per outer step must be >= 1 (0: off), "
                          f"got {cfg.diloco}")
    d = TrainConfig()
    if not cfg.diloco:
        given = [f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in DILOCO_FLAGS
                 if getattr(cfg, k) != getattr(d, k)]
        if given:
            raise ConfigError(f"{', '.join(given)} without --diloco H: replicas meet only in "
                              "DiLoCo's outer steps (pass --diloco H)")
        return
    H, F, tau = cfg.diloco, cfg.fragments, cfg.diloco_delay
    if F < 1 or H % F:
        raise ConfigError(f"--diloco {H} is not a multiple of --fragments {F}: fragment f is "
                          f"synchronized at offset f x H/F")
    if not 0 <= tau < H // F:
        raise ConfigError(f"--diloco-delay {tau} must be in [0, H/F = {H // F}) (--diloco {H} / "
                          f"--fragments {F}): an outer all-reduce must land before the "
                          "fragment's next one starts")
    if not 0 <= cfg.diloco_alpha <= 1:
        raise ConfigError(f"--diloco-alpha {cfg.diloco_alpha} must be in [0, 1]")
    if cfg.outer_lr <= 0 or not 0 <= cfg.outer_momentum < 1:
        raise ConfigError(f"need --outer-lr > 0 and 0 <= --outer-momentum < 1; got "
                          f"{cfg.outer_lr}, {cfg.outer_momentum}")
    if cfg.outer_nesterov and cfg.outer_momentum == 0:
        raise ConfigError("--outer-nesterov needs --outer-momentum > 0 (as torch.optim.SGD); "
                          "pass --no-outer-nesterov for plain outer SGD")
    import pyfast.compress as C
    try:
        C.get(cfg.outer_compress)
    except ValueError as e:
        raise ConfigError(f"--outer-compress {cfg.outer_compress!r}: {e}") from None
    if cfg.zero == 3:  # --zero 1|2 keep fp32 parameters (bf16 autocasts only the forward)
        raise ConfigError("--diloco with --zero 3: stage 3 frees the parameters between "
                          "forward passes and steps separate fp32 master shards, which the "
                          "outer step's merged parameters would never reach; use --zero 1 or "
                          "2 (the optimizer steps views of the parameters DiLoCo sets)")
    if cfg.precision == "fp16":
        raise ConfigError("--diloco with --precision fp16: GradScaler steps the inner optimizer "
                          "itself (scaler.step), around DiLoCo's step, and skips the steps that "
                          "overflow on one replica only, so the replicas' outer schedules would "
                          "part; use bf16 (fp32 parameters, no loss scaling)")


DILOCO_FLAGS = ("replicas", "fragments", "diloco_delay", "outer_compress", "outer_lr",
                "outer_momentum", "outer_nesterov", "diloco_alpha", "eval_outer")


def check_fragments(cfg: TrainConfig, m) -> None:
    """--fragments against the model's parameter tensors (each fragment holds at least one)."""
    n = sum(1 for _ in m.parameters())
    if cfg.diloco and cfg.fragments > n:
        raise ConfigError(f"--fragments {cfg.fragments}: more fragments than the {n} parameter "
                          f"tensors of {cfg.model}")


BASE_DTYPES = ("none", "bf16", "int8", "nf4")
BASE_PLACEMENTS = ("auto", "replicate", "shard")


def add_lora_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("LoRA fine-tuning (adapters through peft; a frozen base)")
    g.add_argument("--lora", type=int, default=d.lora, metavar="R",
                   help="train rank-R LoRA adapters on a frozen base (default 0: full fine-tune)")
    g.add_argument("--lora-alpha", type=float, default=d.lora_alpha,
                   help="the adapters' update is scaled by alpha / R (> 0; default 2 R)")
    g.add_argument("--lora-targets", default=d.lora_targets,
                   help="all-linear (every Linear of the layers, not the head) or module names: "
                        "q_proj,v_proj,...")
    g.add_argument("--lora-dropout", type=float, default=d.lora_dropout)
    g.add_argument("--base-dtype", default=d.base_dtype, choices=BASE_DTYPES,
                   help="store the frozen base's adapted Linear weights as bf16, int8 or nf4 "
                        "(QLoRA); none: as built")
    g.add_argument("--base-placement", default=d.base_placement, choices=BASE_PLACEMENTS,
                   help="--zero 3: keep the frozen base whole on every rank (replicate) or "
                        "shard it like the trainable parameters; auto: replicate when it fits")


def lora_options(cfg: TrainConfig):
    """The LoraOptions of --lora/--lora-alpha/--lora-targets/--lora-dropout (ConfigError)."""
    from pyfast.models.lora import LoraOptions
    try:
        return LoraOptions(cfg.lora, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout)
    except ValueError as e:
        raise ConfigError(f"--lora {cfg.lora}: {e}") from None


def check_lora(cfg: TrainConfig) -> None:
    """The LoRA flags alone (a target that names no module is told by build_model)."""
    if cfg.lora < 0:
        raise ConfigError(f"--lora must be >= 1 (the adapter rank; 0: off), got {cfg.lora}")
    if not cfg.lora:
        for flag, v, default in (("--base-dtype", cfg.base_dtype, "none"),
                                 ("--base-placement", cfg.base_placement, "auto")):
            if v != default:
                raise ConfigError(f"{flag} {v}: the base is frozen only under LoRA adapters; "
                                  "add --lora R (a full fine-tune trains every weight)")
        d = TrainConfig()
        given = [f"--{k.replace('_', '-')} {getattr(cfg, k)}"
                 for k in ("lora_alpha", "lora_targets", "lora_dropout")
                 if getattr(cfg, k) != getattr(d, k)]
        if given:
            raise ConfigError(f"{', '.join(given)} without --lora R: these shape LoRA adapters, "
                              "and a full fine-tune has none (add --lora R)")
        return
    # each value named by its flag (LoraOptions' own checks, which lora_options reports too)
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:  # NaN too
        raise ConfigError(f"--lora-alpha must be > 0 (the update's scale is alpha / R; "
                          f"omitted: 2 R), got {cfg.lora_alpha}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if isinstance(cfg.lora_targets, str) and not cfg.lora_targets.replace(",", "").strip():
        raise ConfigError(f"--lora-targets {cfg.lora_targets!r}: no module name given (e.g. "
                          "q_proj,v_proj, or all-linear)")
    lora_options(cfg)
    if cfg.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"--base-dtype must be one of {', '.join(BASE_DTYPES)}, "
                          f"got {cfg.base_dtype!r}")
    if cfg.base_placement not in BASE_PLACEMENTS:
        raise ConfigError(f"--base-placement must be one of {', '.join(BASE_PLACEMENTS)}, "
                          f"got {cfg.base_placement!r}")
    if cfg.tp > 1 and cfg.base_dtype in ("int8", "nf4"):  # pyfast.parallel.lora_tp
        raise ConfigError(f"--base-dtype {cfg.base_dtype} with --tp {cfg.tp}: tensor "
                          f"parallelism splits a frozen base as built or stored bf16, not "
                          f"blockwise {cfg.base_dtype} codes (they run over the whole weight, "
                          f"not over a shard); use --base-dtype bf16 or --tp 1")
    if cfg.base_placement != "auto" and cfg.zero != 3:
        raise ConfigError(f"--base-placement {cfg.base_placement}: only --zero 3 shards "
                          "parameters (the others keep the base whole on every rank)")
