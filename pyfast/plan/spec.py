"""What the planner reasons about: a model's shape, the workload, and one plan (a `pyfast train`
configuration). Pure arithmetic, no torch: `pyfast plan` scores 10,000 plans in seconds.

Shapes follow two families: "gpt", pyfast's reference GPT (pyfast.models.gpt: LayerNorm with
bias, biased linears, a GELU MLP of `ffn` = mlp_ratio x hidden, multi-head attention, an
untied bias-free LM head unless tied), which `pyfast train` runs and the dry run traces; and
"llama" (RMSNorm, SwiGLU MLP of 3 matrices, grouped-query attention, no biases), for sizing
models pyfast's job does not build (hf:DIR configs, --params presets like 70B).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

ARCHS = ("gpt", "llama")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    arch: str = "gpt"
    tied: bool = False
    name: str = ""

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}")
        if self.hidden % self.heads:
            raise ValueError(f"--heads {self.heads} does not divide --hidden {self.hidden}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--kv-heads {self.kv_heads} does not divide --heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- parameters (elements)
    def layer_params(self) -> int:
        """One transformer block."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        attn = h * (h + 2 * kv) + h * h  # qkv + out projection
        if self.arch == "gpt":
            return attn + (h + 2 * kv) + h + 2 * h * f + f + h + 4 * h  # + biases, 2 LayerNorms
        return attn + 3 * h * f + 2 * h  # SwiGLU's three matrices, two RMSNorm weights

    def adapted_linears(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of each nn.Linear of one block: what LoRA's "all-linear" adapts (the
        LM head excluded). gpt: attn.qkv, attn.proj, mlp.fc, mlp.proj; llama: q, k, v, o,
        gate, up, down (Hugging Face's names)."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.arch == "gpt":
            return ((h, h + 2 * kv), (h, h), (h, f), (f, h))
        return ((h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h))

    def adapter_params(self, rank: int) -> int:
        """Trainable LoRA parameters of the model: r x (in + out) per adapted Linear (A is
        r x in, B out x r), every layer."""
        return self.layers * sum(rank * (i + o) for i, o in self.adapted_linears())

    def layer_matmul_params(self) -> int:
        """The block's weights that are matmul operands (what 6 N counts in FLOPs)."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        return h * (h + 2 * kv) + h * h + (2 if self.arch == "gpt" else 3) * h * f

    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """Final norm + LM head (0 head weights when tied to the embedding)."""
        norm = 2 * self.hidden if self.arch == "gpt" else self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden)

    def params(self) -> int:
        return self.embed_params() + self.layers * self.layer_params() + self.head_params()

    # ---- FLOPs
    def flops_per_token(self, seq: int) -> float:
        """Forward + backward FLOPs per token: 6 x (matmul weights incl. the LM head) plus
        causal attention (QK^T and AV over on average seq/2 keys: 2 x 2 x hidden x seq/2 in
        forward, x3 with backward)."""
        matmul = self.layers * self.layer_matmul_params() + self.vocab * self.hidden
        return 6.0 * matmul + 6.0 * self.layers * self.hidden * seq

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    seq: int
    global_batch: int            # sequences per optimizer step
    precision: str = "bf16"      # fp32 | bf16 | fp16 (autocast with fp32 master weights)

    @property
    def tokens(self) -> int:
        return self.seq * self.global_batch


@dataclass(frozen=True)
class Plan:
    """One `pyfast train` configuration. micro_batch sequences per forward on each rank,
    micro_batches of them per optimizer step (pipelined when pp > 1, accumulated otherwise):
    global_batch = dp x micro_batch x micro_batches."""
    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    compress: str = "none"
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    activation_checkpointing: bool = False
    cp_method: str = "ring"
    param_compress: str = "none"
    # --zero-shard-group N (hybrid sharding, FSDP's HSDP): ZeRO shards over N of the dp x cp
    # ranks (a node's), replicated over the dp x cp / N groups, whose shards are all-reduced
    # with `compress`; 0: over the whole dp x cp group
    shard_group: int = 0
    # --sequence-parallel (tp > 1): norms and the residual stream sharded over tp (memory.py)
    sequence_parallel: bool = False
    # fine-tuning (pyfast/plan/finetune.py): LoRA rank (0: a full fine-tune), the frozen
    # base's storage (none: the training dtype; bf16, int8, nf4) and, under ZeRO 3, whether the
    # base is sharded over dp (shard) or whole on every rank (replicate)
    lora: int = 0
    base_dtype: str = "none"
    base_placement: str = "replicate"
    lora_dropout: float = 0.0
    # --loss-chunks K (pyfast.train.job.Job.chunked_loss): the LM head and the fp32 loss on K
    # checkpointed chunks of the tokens; 0: off. The job refuses it with tp or pp > 1
    loss_chunks: int = 0
    # --offload optimizer|params (pyfast/plan/offload.py): ZeRO's master shards, gradient
    # shards and optimizer state on the host (params, ZeRO 3: the parameter shards and a
    # sharded frozen base too), --offload-prefetch units copied ahead; "none": all on the device
    offload: str = "none"
    prefetch: int = 1
    # tp > 1: each tp collective overlapped with the matmul it feeds or follows (torchtitan's
    # AsyncTP; pyfast/plan/timing_tp.py). `pyfast train` has no flag for it (its layers take
    # ColumnParallelLinear(overlap=...), the job does not pass it): the search never sets it
    async_tp: bool = False
    # ZeRO 3 under a pipeline: each stage's gathered weights kept whole from its first
    # micro-batch's forward to its last backward (FSDP2's reshard_after_forward=False, which
    # torchtitan sets under PP: one gather a unit a step instead of two a micro-batch), in the
    # gathered dtype (param_compress). `pyfast train` regathers every micro-batch and has no
    # flag for it: planner-only, as async_tp (the published runs use it: published.py)
    keep_gathered: bool = False
    # the loss as one fused kernel (torch.compile of the cross-entropy, as torchtitan compiles
    # it under --training.compile since 2025-04): the 16-bit logits (and a log-sum-exp a token)
    # saved, their gradient written 16-bit, where the eager loss keeps the fp32 log-softmax and
    # two fp32 gradients (8B Llama, 16K tokens x 128K vocab: 7.8 GiB against 24).
    # `pyfast train` runs the eager loss: planner-only, as async_tp
    fused_loss: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def ranks(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def virtual_stages(self) -> int:
        return 2 if self.pp > 1 and self.schedule == "interleaved-1f1b" else 1

    def replace(self, **kw) -> "Plan":
        return replace(self, **kw)

    def fields(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d

    def train_flags(self, shape_flag: str, work: Workload) -> list[str]:
        """The `pyfast train` flags of this plan (launch flags aside)."""
        if self.async_tp:
            raise ValueError("async_tp: `pyfast train` has no flag for overlapped tensor "
                             "parallelism (pyfast.parallel.async_tp's layers are not wired to "
                             "the job); this plan cannot be launched as such")
        if self.keep_gathered:
            raise ValueError("keep_gathered: `pyfast train` regathers ZeRO 3's weights every "
                             "micro-batch (no flag keeps them); this plan cannot be launched "
                             "as such")
        if self.fused_loss:
            raise ValueError("fused_loss: `pyfast train` runs the eager cross-entropy (no flag "
                             "fuses it); this plan cannot be launched as such")
        f = ["--model", shape_flag, "--dp", str(self.dp), "--tp", str(self.tp),
             "--pp", str(self.pp), "--seq", str(work.seq), "--batch", str(work.global_batch),
             "--micro-batches", str(self.micro_batches), "--precision", work.precision]
        if self.cp > 1:
            f += ["--cp", str(self.cp), "--cp-method", self.cp_method]
        if self.pp > 1:
            f += ["--schedule", self.schedule]
        if self.zero:
            f += ["--zero", str(self.zero)]
            if self.shard_group:
                f += ["--zero-shard-group", str(self.shard_group)]
        if self.compress != "none":
            f += ["--compress", self.compress]
        if self.param_compress != "none":
            f += ["--param-compress", self.param_compress]
        if self.activation_checkpointing:
            f += ["--activation-checkpointing"]
        if self.lora:
            f += ["--lora", str(self.lora)]
            if self.base_dtype != "none":
                f += ["--base-dtype", self.base_dtype]
            if self.zero == 3:
                f += ["--base-placement", self.base_placement]
            if self.lora_dropout:
                f += ["--lora-dropout", f"{self.lora_dropout:g}"]
        if self.loss_chunks:
            f += ["--loss-chunks", str(self.loss_chunks)]
        if self.offload != "none":
            f += ["--offload", self.offload]
            if self.prefetch != 1:
                f += ["--offload-prefetch", str(self.prefetch)]
        return f

    @property
    def finetune(self) -> str:
        """full, lora (a 16-bit or training-dtype base) or qlora (an int8 / nf4 base)."""
        if not self.lora:
            return "full"
        return "qlora" if self.base_dtype in ("int8", "nf4") else "lora"


def gpt_model_flag(shape: ModelShape) -> str:
    """The `--model` of `pyfast train` that builds this shape (the reference GPT only)."""
    from_presets = {(2, 4, 64): "gpt-tiny", (6, 8, 384): "gpt-small"}
    key = (shape.layers, shape.heads, shape.hidden)
    if shape.arch != "gpt" or shape.kv_heads != shape.heads or shape.ffn % shape.hidden:
        raise ValueError(f"{shape.name or 'this model'} is not pyfast's reference GPT (arch "
                         f"{shape.arch}, kv_heads {shape.kv_heads}, ffn {shape.ffn}): `pyfast "
                         "train` cannot build it")
    ratio = shape.ffn // shape.hidden
    if key in from_presets and ratio == 4:
        return from_presets[key]
    return (f"gpt:layers={shape.layers},heads={shape.heads},hidden={shape.hidden}"
            + (f",mlp={ratio}" if ratio != 4 else ""))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []
