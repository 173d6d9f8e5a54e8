"""Fine-tuning plans: LoRA adapters on a frozen base (`pyfast train --lora R --base-dtype X
[--base-placement shard]`), their memory per rank. Pure arithmetic, no torch.

Kinds (`pyfast plan --finetune`): full (every weight trains: memory.py's model), lora (rank-R
adapters on every Linear of the layers, the base frozen in bf16 -- in the training dtype under
fp32), qlora (the base's Linear weights stored int8 or NF4). auto: full if a full plan fits,
else lora, else qlora (the most faithful update that fits, then the fastest; cli.py).
The search (search.py) plans them on dp-only meshes (tp = cp = pp = 1): DataParallel or ZeRO
1-3, and under ZeRO 3 the base replicated (whole on every rank, no gather) or sharded over dp
(all-gathered in its stored format per layer).

Memory per rank (lora_memory), N = dp, r = the rank, P_b = the frozen base:
- parameters: the base's adapted Linear weights in their stored format (bf16 2 bytes; int8 1
  byte + an fp32 absmax per 64 = 8.5 bits; nf4 4.5 bits; none: the training dtype), the LM
  head's weight bf16 under bf16 (job.store_frozen_linear stores every frozen Linear so), the
  rest of the base (embedding, norms, biases) fp32, as pyfast's job keeps them (REST; measured
  on gpt-small, 2 gloo ranks, bf16), /N when sharded; the adapters fp32, A = sum over
  adapted Linears in x out of r (in + out), /N under ZeRO 3; the rotary buffers as memory.py.
- gradients: the adapters' only, 4A (ZeRO 2/3: 4A/N once reduced); the base never has any.
- optimizer: AdamW's two fp32 moments of the adapters, 8A (ZeRO: /N) + 4 bytes a tensor, and
  the step's temporaries as memory.py.
- comm_buffers: DataParallel's buckets of the adapters' gradients, 4A.
- activations: the base model's (activations._block_saved: what a block saves per token, the same
  tensors: the adapters' A reads the Linear's input the base would have saved) with the chosen
  recompute (a recomputed layer's input in the embedding's dtype, REST: it starts the residual
  stream, which autocast's bf16 outputs added to it keep there), plus per adapted Linear the
  r-wide output of A (saved by B), and with dropout its output and 1-byte mask, in-wide; a base
  stored int8/nf4 (or bf16 under fp32) is dequantized into the training dtype just before its
  matmul and again in backward, never saved (models/quant_base._FrozenLinear): while one Linear
  runs, its dequantized weight (the largest, in the training dtype) is live. ZeRO 3, while a
  layer runs: two gathered units (this layer and the prefetched one): their adapters fp32, and
  when sharded the base's layer in its stored format (none during the head's backward: the dry
  run's 8B Llama). The head: the final norm's input and output, and the fp32 log-softmax of
  every token (F32 x vocab), with the loss's gradient dlogits (2 x F32 x vocab) in its backward;
  with --loss-chunks K (plan.loss_chunks, Job.chunked_loss) only one chunk's (ceil(tokens / K)
  tokens) log-softmax and dlogits, the head's input kept whole by the chunks' checkpoints and
  its gradient gathered chunk by chunk (F32 x hidden a token). Checked against the dry run
  (bench plan_finetune): 8B Llama, zero 3 sharded, --loss-chunks 8, 2 and 4 ranks, bf16 and nf4.
"""
from __future__ import annotations

from .spec import ModelShape, Plan, Workload

F32 = 4
QBLOCK = 64          # pyfast.models.quant_base.BLOCK: one fp32 absmax per 64 weights
FINETUNES = ("full", "lora", "qlora", "auto")
BASE_DTYPES = ("none", "bf16", "int8", "nf4")   # pyfast.train.config.BASE_DTYPES
PLACEMENTS = ("replicate", "shard")
QLORA_DTYPES = ("nf4", "int8")
DEFAULT_RANK = 16
# bytes of a frozen parameter that is not an adapted Linear's weight (embedding, norms,
# biases, head), and so of the residual stream the embedding starts: fp32, as the job builds
# them (measured: gpt-small LoRA bf16 with recompute, 2 gloo ranks: fp32 checkpoints)
REST = F32
# the adapted Linears (shape.adapted_linears order) fed by a norm: under autocast a LayerNorm's
# output is fp32, so dropout's output, which A's cast reads, is fp32 there
NORM_FED = {"gpt": (0, 2), "llama": (0, 1, 2, 4, 5)}


def stored_bytes(n: int, fmt: str, train_bytes: int) -> int:
    """Bytes of an n-element frozen weight stored as fmt (quant_base.quantize_weight)."""
    if fmt == "none":
        return train_bytes * n
    if fmt == "bf16":
        return 2 * n
    codes = n if fmt == "int8" else -(-n // 2)
    return codes + F32 * -(-n // QBLOCK)


def base_layer_bytes(shape: ModelShape, fmt: str, train_bytes: int, rest: int = REST) -> int:
    """One block's frozen base: its Linear weights stored as fmt, the rest (norms, biases)
    `rest` bytes each."""
    lin = sum(stored_bytes(i * o, fmt, train_bytes) for i, o in shape.adapted_linears())
    return lin + rest * (shape.layer_params() - shape.layer_matmul_params())


def head_weight_bytes(precision: str, rest: int = REST) -> int:
    """Bytes of an element of the frozen LM head's weight (an untied nn.Linear): under bf16 the
    job stores every frozen Linear's weight in bf16 (job.store_frozen_linear), the head's too;
    otherwise `rest`."""
    return min(2, rest) if precision == "bf16" else rest


def base_bytes(shape: ModelShape, fmt: str, train_bytes: int, rest: int = REST,
               head: int | None = None) -> int:
    """The whole frozen base: the blocks, the embedding, the final norm and the head (its
    weight `head` bytes an element, default rest)."""
    head = rest if head is None else head
    lm = 0 if shape.tied else shape.vocab * shape.hidden
    return shape.layers * base_layer_bytes(shape, fmt, train_bytes, rest) + \
        rest * (shape.embed_params() + shape.head_params() - lm) + head * lm


def check(plan: Plan) -> None:
    """What the LoRA model covers (ValueError otherwise)."""
    if plan.lora < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {plan.lora}")
    if plan.base_dtype not in BASE_DTYPES:
        raise ValueError(f"base dtype must be one of {BASE_DTYPES}, got {plan.base_dtype!r}")
    if plan.base_placement not in PLACEMENTS:
        raise ValueError(f"base placement must be one of {PLACEMENTS}, got "
                         f"{plan.base_placement!r}")
    if plan.base_placement == "shard" and plan.zero != 3:
        raise ValueError("base placement shard: only ZeRO 3 shards parameters")
    if (plan.tp, plan.cp, plan.pp) != (1, 1, 1):
        raise ValueError(f"LoRA plans are modelled on dp-only meshes; got tp {plan.tp}, "
                         f"cp {plan.cp}, pp {plan.pp}")


def lora_memory(shape: ModelShape, plan: Plan, work: Workload, device: str,
                logits: bool = True, rest: int | None = None) -> dict:
    """memory.predict_memory's answer for a LoRA plan (module doc). What-ifs: logits=False, no
    vocab-wide fp32 tensor per token held at all (the job's --loss-chunks keeps one chunk's:
    plan.loss_chunks); rest=2, the embedding, norms and biases stored in bf16 (and so the
    residual stream), as torchtune does (the job: fp32, REST)."""
    from .activations import KINDS, _block_saved
    check(plan)
    n = plan.dp
    zero = plan.zero if n > 1 or plan.offload != "none" else 0  # one rank: ZeRO-Offload
    shard = zero == 3 and plan.base_placement == "shard" and n > 1
    tb = F32 if work.precision == "fp32" else 2      # the training dtype's bytes
    rest = REST if rest is None else rest
    bpe = tb                                         # autocast: 16-bit matmul outputs
    h, r, L = shape.hidden, plan.lora, shape.layers
    lins = shape.adapted_linears()
    A = shape.adapter_params(r)
    a_layer = A // L
    n_tensors = 2 * len(lins) * L
    big_a = max(r * max(i, o) for i, o in lins)      # the largest adapter tensor
    tok = plan.micro_batch * work.seq
    rotary = 2 * work.seq * (shape.head_dim // 2) * F32 * L
    cdiv = lambda x: -(-x // n)  # noqa: E731  (shard 0's: ceil)

    k = dict.fromkeys(KINDS, 0.0)
    frozen = base_bytes(shape, plan.base_dtype, tb, rest, head_weight_bytes(work.precision, rest))
    k["parameters"] = (cdiv(frozen) if shard else frozen) + \
        F32 * (cdiv(A) if zero == 3 else A) + rotary
    k["optimizer"] = 2 * F32 * (cdiv(A) if zero else A) + F32 * n_tensors
    k["comm_buffers"] = F32 * A if (n > 1 and not zero) else 0
    grads_full = F32 * A
    grads_end = F32 * cdiv(A) if zero >= 2 else grads_full
    state_opt, off = k["optimizer"], plan.offload if zero else "none"
    unit = F32 * a_layer + (base_layer_bytes(shape, plan.base_dtype, tb, rest) if shard else 0)
    if off != "none":  # offload.py: the adapters' master, gradient shards, state on the host
        from .offload import host_state
        base_host = cdiv(frozen) if off == "params" and shard else 0
        host = host_state(F32 * cdiv(A), F32 * cdiv(A), k["optimizer"], F32 * cdiv(big_a),
                          base_host)
        k["optimizer"] = 0.0
        if off == "params":  # no device shard: the sharded base, the adapters' shards
            k["parameters"] = rotary + (0 if shard else frozen)

    # ---- activations of a micro-batch
    saved, temp = _block_saved(shape, 1, work.seq, device, "ring", 1, bpe, plan.micro_batch)
    saved += bpe * r * len(lins)                     # A's outputs, saved by B
    if plan.lora_dropout > 0:  # dropout's output (A's input; fp32 after a norm) and its mask
        fed = NORM_FED[shape.arch]
        saved += sum(((F32 if j in fed else bpe) + 1) * i for j, (i, _) in enumerate(lins))
    # a dequantized weight is rebuilt in backward, not saved (quant_base._FrozenLinear): only
    # the Linear running now holds one
    dequantizes = plan.base_dtype in ("int8", "nf4") or (plan.base_dtype == "bf16" and tb == F32)
    big_lin = max(i * o for i, o in lins)
    deq_live = big_lin * tb if dequantizes else 0
    ckpt = plan.activation_checkpointing
    if ckpt:  # every layer's input; one layer recomputed at a time
        # (in the embedding's dtype: the residual stream's)
        act = tok * rest * h * L
        layer = tok * saved + max(tok * temp, deq_live)
    else:
        act = tok * saved * L
        layer = max(tok * temp, deq_live)
    if plan.fused_loss:
        raise ValueError("fused_loss with lora: the fine-tuning model keeps the eager loss's "
                         "fp32 log-softmax; plan one or the other")
    vocab = shape.vocab if logits else 0
    head = tok * (F32 * 2 * h + 8 + F32 * vocab)          # the head: LN in/out, log-softmax
    t_head = tok * F32 * 2 * vocab                        # dlogits, the loss's gradient
    if plan.loss_chunks:  # --loss-chunks K: one chunk's log-softmax and dlogits at a time, the
        # head's input saved whole (the checkpoints'), its gradient gathered chunk by chunk
        ct = -(-tok // min(plan.loss_chunks, tok))
        head = tok * (F32 * 2 * h + 8) + ct * F32 * vocab
        t_head = tok * F32 * h + ct * F32 * 2 * vocab
    if zero == 3:  # a layer's unit and the prefetched one, while a layer runs (the dry run
        # holds none of them during the head's backward: 8B Llama, --zero 3, base sharded)
        from .offload import params_extra
        layer += 2 * unit + params_extra(plan, unit, n)
    g_start = (grads_end if zero >= 2 else grads_full) if plan.micro_batches > 1 else 0.0
    # the head's backward (its saved tensors and dlogits) ends before the last layer's
    # backward (or its recompute) starts: the two are never live together
    start = (g_start, act + max(head + t_head, layer))
    # the end of backward: all the adapters' gradients, the first layer's activations only
    g_end = grads_full if zero < 2 else grads_end + 2 * min(4 * 2**20, F32 * A)
    end = (g_end, tok * saved + max(tok * temp, deq_live))
    g, ac = max(start, end, key=sum)
    static = sum(k.values())
    fwd = static + g + ac
    if device == "cuda":
        opt_t = F32 * (cdiv(A) if zero else A)       # foreach AdamW: sqrt(exp_avg_sq)
    else:
        opt_t = 3 * F32 * (cdiv(big_a) if zero else big_a)
    if off != "none":  # the step on the host
        opt_t = 0.0
    # offload: the reduced shards leave the device at the end of backward (memory.py)
    grads_opt = grads_full + F32 * cdiv(A) if zero == 1 else \
        (0.0 if off != "none" else grads_end)
    opt = static + grads_opt + opt_t
    if fwd >= opt:
        k["gradients"], k["activations"] = g, ac
        phase = "forward/backward"
    else:
        k["gradients"], k["optimizer"] = grads_opt, k["optimizer"] + opt_t
        phase = "optimizer step"
    row = {kk: int(vv) for kk, vv in k.items()}
    row["peak_bytes"] = sum(row[kk] for kk in KINDS)
    row["where"], row["phase"] = "dp rank 0", phase
    row["state"] = {"parameters": int(k["parameters"]),
                    "gradients": int(0 if off != "none" and zero >= 2 else grads_end),
                    "optimizer": int(state_opt if off == "none" else 0)}
    if off != "none":
        from .offload import add
        add(row, host)
    row["adapter_params"] = A
    row["base_bytes"] = frozen
    row["per_stage"] = [row["peak_bytes"]]
    return row
