"""Memory per rank of a plan: what pyfast's own job (pyfast.train.job.Job) holds at the peak of
one optimizer step, by the kinds pyfast.train.memory counts (parameters, gradients, optimizer,
activations, comm_buffers, feedback). Pure arithmetic: no torch import; ~50 us a plan.

predict_memory(shape, plan, work, device="cuda") -> {"parameters", "gradients", "optimizer",
    "activations", "comm_buffers", "feedback", "peak_bytes", "where", "phase", "per_stage"}:
    the kinds at the peak of the rank that needs the most ("where": "pp stage 2"; under ZeRO
    shard 0, whose torch.chunk shards are the longest; "phase": "forward/backward" or
    "optimizer step"); "per_stage": each stage's peak; "state": the model state after
    backward (parameters, gradients, optimizer: ZeRO's formula).

What each rank holds (fp32; P = this rank's parameters: its pipeline stage's layers, split by
tp -- qkv, proj, fc, mlp.proj by tp, LayerNorms and row-parallel biases whole, embedding and
LM head by tp only when vocab >= 2048, models/gpt.py VOCAB_PARALLEL_MIN):
- parameters 4P (+ the rotary cos/sin buffers, seq x head_dim per layer); ZeRO 3: the fp32
  master shards 4P/N (N = dp x cp), the gathered units counted as activations, as the dry run.
- gradients 4P (.grad); ZeRO 2/3: the reduced shards 4P/N once backward is over.
- optimizer: AdamW's exp_avg and exp_avg_sq, 8P (ZeRO 1-3: 8P/N), and in the optimizer step
  its temporaries: torch's single-tensor AdamW (CPU, and the dry run's meta device) makes 3
  tensors of the largest parameter at once (measured in the dry run); on CUDA torch picks the
  foreach AdamW, whose sqrt of exp_avg_sq is one tensor per group: + 4 bytes a parameter.
- comm_buffers: DataParallel's fp32 buckets (pyfast.comm.buckets), 4P rounded up per parameter
  to the compressor's block (512 for int8/int4/fp8/sign); 3 buckets (4 MB) of compressor
  buffers in flight while backward runs; a pipeline's received activations and gradients.
- feedback: error-feedback memory (pyfast.compress.feedback) of a lossy compressor, one fp32
  element per bucket element: 4P (PowerSGD: the matrices it factors only); under ZeRO each rank
  compresses every chunk it sends in the reduce-scatter, so again 4P, padded per shard.
- activations: per token of a micro-batch, per layer, the tensors pyfast's Block saves for
  backward (the derivation in _block_saved, Korthikanti et al. 2022's method on this GPT's own
  layers), times the micro-batches a pipeline stage holds (schedule: gpipe m, 1F1B p - rank,
  zb-h1 until each W, interleaved by simulation), plus the head (LayerNorm, logits and
  log-softmax, fp32 [tokens, vocab/tp]) and the largest temporary of the backward. With
  activation checkpointing a layer keeps only its input, and one layer is recomputed at a time.
  ZeRO 3 holds two gathered units (this one and the prefetched); with plan.keep_gathered
  (FSDP2's reshard_after_forward=False under a pipeline) the whole stage's weights, in the
  gathered dtype, from the first micro-batch's forward to the last backward. plan.fused_loss
  (a compiled cross-entropy): the head keeps the 16-bit logits, its gradient 16-bit.

A LoRA plan (plan.lora > 0: a frozen base under adapters) is finetune.py's model
(finetune.lora_memory), which reuses _block_saved for the base's activations. An offload plan
(plan.offload, ZeRO): the kinds are the device's; "host" / "host_bytes" what offload.py moves.

The peak is the larger of two phases: forward/backward (activations at the start of the last
micro-batch's backward, or the full gradients at its end when those outweigh them) and the
optimizer step (no activations, AdamW's temporaries); the worst pipeline stage and ZeRO shard.

device: "cuda" (the default: what a GPU job holds: flash / memory-efficient attention, saving
q, k, v, the output and the log-sum-exp per token; foreach AdamW), "cpu" (flash attention too,
single-tensor AdamW) or "meta" (the dry run: single-tensor AdamW; attention as the
memory-efficient kernel's op, which train/meta_autocast.py sends scaled_dot_product_attention to
on meta tensors, as a GPU runs it). "meta-math": the dry run before that, when torch ran
attention on meta tensors as its math decomposition, keeping the fp32 softmax, heads x seq x seq
per sequence (bench/results/plan_memory.txt was measured so).

Precision: fp32 is modelled exactly (what the dry run checks). bf16 / fp16 (autocast with fp32
master weights) are analytic, checked by the dry run's MetaAutocast (train/meta_autocast.py,
`pyfast plan --verify`): parameters, gradients and optimizer state stay fp32, the matmul outputs and the inputs
the linears save are 16-bit, the LayerNorm and softmax outputs fp32 (autocast's fp32 ops).
"""
from __future__ import annotations

from functools import lru_cache

from pyfast._partition import on_a_line, partition

from .activations import KINDS, _block_saved, korthikanti_activation_bytes  # noqa: F401
from .held import _held
from .sharding import (BLOCKED, QUANT_BLOCK, blocked as _blocked,  # noqa: F401
                       check_keep_gathered, hybrid_compressors, shard_group)
from .timing_reduce import gathered_bytes
from .offload import add as add_host, check as check_offload, host_state, params_extra
from .spec import ModelShape, Plan, Workload

F32 = 4
LOSSY = BLOCKED + ("topk", "randomk", "powersgd")
BUCKET_MB = 4.0        # pyfast.parallel.data.BUCKET_MB (ZeRO's units too)
VOCAB_PARALLEL_MIN = 2048  # pyfast.models.gpt.VOCAB_PARALLEL_MIN
DEVICES = ("cuda", "cpu", "meta", "meta-math")
# a compressor's payload per fp32 bucket byte (codes + scales; top-k's values and indices)
PAYLOAD = {"none": 0.0, "bf16": 0.5, "fp16": 0.5, "fp8": 0.26, "int8": 0.26, "int4": 0.13, "e3m0": 0.13,
           "sign": 0.04, "ternary": 0.07, "topk": 0.02, "randomk": 0.02, "powersgd": 0.25}


def _vocab_split(shape: ModelShape, tp: int) -> int:
    return tp if shape.vocab >= VOCAB_PARALLEL_MIN else 1


def _layer_tensors(shape: ModelShape, tp: int) -> tuple[int, ...]:
    """Element counts of one Block's parameters on one tp rank (registration order)."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_dim
    return (h, h, (h + 2 * kv) * h // tp, (h + 2 * kv) // tp, h * h // tp, h,
            h, h, f * h // tp, f // tp, h * f // tp, h)


@lru_cache(maxsize=4096)
def _partition(shape: ModelShape, n: int, tp: int) -> tuple[int, ...]:
    """Layers of each of n stages as Pipeline.from_sequential(balance="params") cuts
    [Embed, Block x L, Head] (pyfast._partition.partition, the pipeline's own: the heaviest
    stage's parameters minimised, ties to the most even layer counts)."""
    vt = _vocab_split(shape, tp)
    block = sum(_layer_tensors(shape, tp))
    head = 2 * shape.hidden + (0 if shape.tied else shape.vocab * shape.hidden // vt)
    w = [shape.vocab * shape.hidden // vt] + [block] * shape.layers + [head]
    return tuple(partition(w, n))


@lru_cache(maxsize=65536)
def _static(shape: ModelShape, tp: int, pp: int, v: int) -> tuple:
    """Per pipeline rank: (its parameter tensors' sizes, the blocks of each of its local
    stages, whether it holds the last stage)."""
    counts = _partition(shape, pp * v, tp)
    vt = _vocab_split(shape, tp)
    layer = _layer_tensors(shape, tp)
    out = []
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    n_seq = shape.layers + 2
    for r in range(pp):
        tensors, stage_layers = [], []
        for s in range(r, pp * v, pp):
            nl = 0
            for i in range(bounds[s], bounds[s + 1]):
                if i == 0:
                    tensors.append(shape.vocab * shape.hidden // vt)
                elif i == n_seq - 1:
                    tensors += [shape.hidden, shape.hidden]
                    if not shape.tied:
                        tensors.append(shape.vocab * shape.hidden // vt)
                else:
                    tensors += layer
                    nl += 1
            stage_layers.append(nl)
        out.append((tuple(tensors), tuple(stage_layers), bounds[(pp * v - pp) + r + 1] == n_seq))
    return tuple(out)


@lru_cache(maxsize=65536)
def _sizes(tensors: tuple, n: int, align: int, vec: int) -> tuple[int, ...]:
    """(elements, the largest tensor, elements with each tensor padded to `align` (a bucket),
    ZeRO shard rank 0's (ceil(t / n), padded), the same two for the matrices only)."""
    pad = lambda x: -(-x // align) * align  # noqa: E731
    mats = [t for t in tensors if t > vec]
    return (sum(tensors), max(tensors, default=0), sum(map(pad, tensors)),
            sum(pad(-(-t // n)) for t in tensors), sum(map(pad, mats)),
            sum(pad(-(-t // n)) for t in mats))


def _comp(spec: str) -> str:
    return spec.split(":")[0]


def predict_memory(shape: ModelShape, plan: Plan, work: Workload, device: str = "cuda") -> dict:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if work.precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {work.precision!r}")
    check_offload(plan, plan.dp * plan.cp)
    check_keep_gathered(plan)
    kept_bytes = gathered_bytes(plan) if plan.keep_gathered else 0.0
    if plan.lora:  # a frozen base under LoRA adapters: finetune.py's model
        from .finetune import lora_memory
        return lora_memory(shape, plan, work, device)
    tp, pp, cp, dp, v = plan.tp, plan.pp, plan.cp, plan.dp, plan.virtual_stages
    n = dp * cp  # the gradient-averaging group (DataParallel or ZeRO's shards)
    zero = plan.zero if n > 1 or plan.offload != "none" else 0  # one rank: ZeRO-Offload
    ns = shard_group(plan)  # the ranks ZeRO shards over: n, or a node's (hybrid sharding)
    comp, rcomp = (_comp(c) for c in hybrid_compressors(plan))
    bpe = F32 if work.precision == "fp32" else 2  # autocast: 16-bit matmul outputs
    h, a = shape.hidden, shape.heads
    # --sequence-parallel: the residual stream between blocks (a checkpoint, a pipeline
    # message) is the tp rank's slice of the sequence, h/tp a token
    sp = plan.sequence_parallel and tp > 1
    hs = h / tp if sp else h
    s_local = work.seq // cp
    tok = plan.micro_batch * s_local  # tokens per micro-batch on this rank
    vt = _vocab_split(shape, tp)
    rotary = 2 * work.seq * (shape.head_dim // 2) * F32  # cos, sin per layer (buffers)
    align = QUANT_BLOCK if _blocked(comp, rcomp) else 1
    lossy = comp in LOSSY
    saved, temp = _block_saved(shape, tp, work.seq if not (cp > 1 and plan.cp_method == "ring")
                               else s_local, device, plan.cp_method, cp, bpe, plan.micro_batch,
                               sp)
    ckpt = plan.activation_checkpointing
    # ZeRO under a pipeline: each stage's gradients accumulate whole over the micro-batches
    # and are reduce-scattered after the stage's last backward (Megatron's distributed
    # optimizer; pyfast's job calls reduce_gradients() after the pipeline, as DataParallel's)
    piped = pp > 1 and zero > 0
    rows = []
    for r, (tensors, stage_layers, last) in enumerate(_static(shape, tp, pp, v)):
        layers = sum(stage_layers)
        # ZeRO's shard of each tensor on shard rank 0 (the longest: ceil), padded to align
        vec = max(h, shape.ffn // tp, (h + 2 * shape.kv_dim) // tp)  # the longest vector
        P, big, aligned, shard, mats_aligned, mats_shard = _sizes(tensors, ns, align, vec)
        k = dict.fromkeys(KINDS, 0.0)
        k["parameters"] = F32 * (P if zero < 3 else shard) + rotary * layers
        k["optimizer"] = 2 * F32 * (P if not zero else shard) + F32 * len(tensors)
        if lossy and n > 1:
            pw = comp == "powersgd"  # it factors the matrices only
            # DataParallel's all-reduce: each rank compresses every chunk it sends in the
            # reduce-scatter (the whole bucket) and, blockwise codecs, its reduced chunk again
            # for the all-gather (1/N more); ZeRO's reduce-scatter only the former
            # (python engine: meta, and CUDA without a CUDA build of pyfast._C; the native
            # engine on CPU keeps only the former: measured on 2 gloo ranks)
            again = 1 + 1 / n if (comp in BLOCKED and not zero and device != "cpu") else 1
            k["feedback"] = F32 * again * ((mats_aligned if pw else aligned) if not zero else
                                           ns * (mats_shard if pw else shard))
        if zero and work.precision == "fp16":
            # ZeroGradScaler stages the error-feedback memory (a spare of each buffer) so an
            # overflowing step can put it back: twice the memory (124M ZeRO 2 dp 8 int8 fp16:
            # traced 1,977 MiB, 1,603 predicted with one copy)
            k["feedback"] *= 2
        if rcomp in LOSSY and ns < n:
            # hybrid sharding: the replicas' all-reduce of each unit's shard keeps one fp32
            # element of memory per shard element; blockwise codecs on the python engine code
            # the reduced chunk again for the all-gather, as DataParallel's (1/R more)
            again = 1 + ns / n if (rcomp in BLOCKED and device != "cpu") else 1
            k["feedback"] += F32 * again * shard
        buckets = F32 * aligned if (n > 1 and not zero) else 0
        k["comm_buffers"] = buckets
        grads_full = F32 * P
        grads_end = F32 * shard if zero >= 2 else grads_full
        state_opt = k["optimizer"]
        off = plan.offload if zero else "none"
        unit3 = F32 * max(sum(_layer_tensors(shape, tp)), big)  # stage 3's gathered unit
        if off != "none":  # offload.py: master, gradient shards and state on the host
            host = host_state(F32 * shard, F32 * shard, k["optimizer"], F32 * -(-big // ns))
            k["optimizer"] = 0.0
            if off == "params":
                k["parameters"] = rotary * layers
            # the reduced gradient shards stay on the device until the end of backward (as
            # without offload), then go to the host: offload_step copies every unit's in
            # ZeroModel._finish, after the side band. Streaming each unit's as its reduce-scatter
            # ends would save them (4 shard); the dry run traced them: gpt-7b-shaped ZeRO 2 dp 2
            # 37.3 GB device, 25.6 predicted without them (bench plan_offload)

        # ---- forward/backward: held micro-batches x layers
        per_layer = F32 * hs if ckpt else saved
        if pp > 1:
            # a layer's output gradients W starts from (zb-h1): LayerNorms 2h, qkv, proj, fc,
            # mlp.proj outputs
            w_split = (2 * h * F32 + F32 * ((3 * h + shape.ffn) / tp + 2 * h)) * tok * \
                stage_layers[0]
            # the replay needs only the ratios of the weights: rounded, they cache well
            unit = tok * per_layer * max(1, stage_layers[0])
            weights = tuple(round(nl / max(1, stage_layers[0]), 3) for nl in stage_layers)
            held, n_split, sent, kept = _held(plan.schedule, r, pp, plan.micro_batches, v, weights,
                                        round(w_split / unit, 3), round(tok * F32 * hs / unit, 3))
            grads_on = sent > 0
        else:
            held, n_split, grads_on = (1,), 0, plan.micro_batches > 1
        held_layers = sum(c * nl for c, nl in zip(held, stage_layers)) + \
            n_split * stage_layers[0]
        act = tok * per_layer * held_layers
        if n_split:
            act += n_split * w_split
        rec = tok * saved if ckpt else 0.0  # one block recomputed at a time
        if pp > 1:
            # pyfast.parallel.p2p: a stage keeps its output until the output's gradient
            # returns; a received activation is the next layer's saved input
            outs = sum(c for i, c in enumerate(held) if i * pp + r != pp * v - 1) + \
                (n_split if not last else 0)
            act += tok * F32 * hs * outs
            # the packed copies of what it sent, until each send completes: on a CPU (gloo,
            # whose I/O thread the Pipeline lowers) where the ranks form a line (v == 1 or two
            # ranks) each send is waited as it is made, so one copy a boundary it sends on, in
            # that link's pool (gpt-small pp2 1f1b, stage 0: 0.75 MiB of comm buffers traced
            # when the copy was dropped, 1.5 predicted with every one); around a ring of 3+
            # ranks, NCCL (and the dry run's fake group) keeps them until a later message from
            # that peer shows them received (p2p.Peer.release)
            line = on_a_line(pp, v)  # Pipeline.from_sequential's wait_sends
            sent_copies = 2 * v - (r == 0) - last if device == "cpu" and line else outs + kept
            k["comm_buffers"] += tok * F32 * hs * sent_copies
        t_block = tok * temp
        t_head = head = 0.0
        if last:
            v_local = shape.vocab / vt
            if plan.fused_loss:  # the 16-bit logits and a log-sum-exp; dlogits 16-bit
                head = tok * (F32 * 2 * h + 8 + bpe * v_local + F32)
                t_head = tok * bpe * v_local
            else:
                head = tok * (F32 * 2 * h + 8 + F32 * v_local)  # LN in/out, log-softmax out
                t_head = tok * F32 * 2 * v_local  # dlogits, the loss's gradient
        if pp > 1:  # received activations and gradients in flight (p2p buffers)
            k["comm_buffers"] += 2 * tok * F32 * hs
        if zero == 3:  # the gathered units of the forward (this one and the prefetched)
            act += params_extra(plan, unit3, ns) + \
                (kept_bytes * P if kept_bytes else 2 * unit3)  # or the whole stage, kept
        # a compressor's buffers while a bucket is in flight: its payload, a fraction of the
        # bucket (measured in the dry run, gpt-small: int8 1 MB, PowerSGD 0-3 MB, top-k 0.02
        # MB of 4 MB buckets); ZeRO's are the packed unit of `end` below
        comm_t = min(BUCKET_MB * 2**20, F32 * P) * PAYLOAD.get(comp, 0.25) \
            if (n > 1 and not zero) else 0
        # a pipeline's later micro-batches and accumulation run a forward after a backward:
        # the gradients are all there at the activations' peak, whole under every ZeRO stage
        # (the job accumulates them in .grad under no_sync, as DDP and FSDP2's
        # set_requires_gradient_sync(False): gpt-124M-shaped ZeRO 2 on dp 8, 2 micro-batches,
        # traced 1,409 MiB, 1,166 predicted when this counted the shards only)
        g_at_start = grads_full if grads_on else 0.0
        # the head's backward (its saved tensors, dlogits) ends before the last block's backward
        # or recompute starts: the two are never live together
        start = (g_at_start, act + max(rec + t_block, head + t_head))  # (grads, activations)
        # end of the backward: all gradients, the first layer's activations only
        # (ZeRO 2/3: the shards, and a unit's packed gradients with its reduced segment), less
        # the gradients of the layer still running when none came before it; its input is
        # the checkpoint's, counted once
        g_end = grads_full if zero < 2 or piped else \
            grads_end + 2 * min(BUCKET_MB * 2**20, F32 * P)
        if not grads_on and layers:
            g_end -= F32 * sum(_layer_tensors(shape, tp)) / (n if zero >= 2 else 1)
        end = (g_end, (tok * saved if ckpt else tok * per_layer) + t_block)
        mid = (0.0, 0.0)
        if zero == 3 and not piped and layers:
            # stage 3's units are layers, not 4 MB buckets: between two layers' backward the
            # dry run holds a gathered unit and the next one's, and the packed gradients of
            # the one before (a whole unit) in its reduce-scatter, the shards of those two not
            # reduced yet, before the next layer's recompute starts (gpt-7b-shaped, seq 1024,
            # recompute, dp 8: traced 14,455 MiB, every one of those and no layer's
            # activations; 12.2% under it when this counted two 4 MB buckets; plan_offload)
            # (where a layer is about a 4 MB bucket, `end` is the larger: 3 x 384 tp 2 int8)
            mid = (grads_end + unit3 - (0 if grads_on else 2 * unit3 / ns),
                   2 * unit3 + params_extra(plan, unit3, ns))
        g, ac = max(start, end, mid, key=sum)
        static = sum(k.values())
        fwd = static + g + ac + comm_t
        # ---- optimizer step: full gradients (ZeRO: shards), AdamW's temporaries
        if device == "cuda":
            opt_t = F32 * (P if not zero else shard)  # foreach: sqrt(exp_avg_sq) per group
        else:
            opt_t = 3 * F32 * (big if not zero else -(-big // n))
        if off != "none":  # the step on the host: no AdamW temporaries here
            opt_t = 0.0
        if zero in (1, 2):  # after the step, all-gather: two units in flight (seg + full),
            # at most the whole stage once (+ its segment): a 3 x 384 pp2 stage of 5.2 MB
            # traced 6.9 MB of temporaries, 10.3 predicted as two whole stages
            opt_t = max(opt_t, min(2 * BUCKET_MB * 2**20, F32 * P) * (1 + 1 / ns))
        # ZeRO 1 reduce-scatters at step(), every stage under a pipeline after it: the full
        # .grad until each unit is packed (packing frees it: with the reduced shards, no unit
        # more), then the step on the shards. Both at once overcounted a pipeline's stage: 350M
        # pp2 zero 1 traced 36.6 MB, 47.5 predicted (gpt 3 x 384, seq 64)
        if zero == 1 or (zero and piped):
            # (offload: each unit's reduced shard goes to the host as it is packed: one unit's
            # on the device; gpt-7b-shaped ZeRO 1 dp 2 traced 49.5 GB, 49.2 predicted so)
            reduce_g = grads_full + (F32 * min(BUCKET_MB * 2**20, P) / ns if off != "none"
                                     else F32 * shard)
            kept = 0.0 if off != "none" else F32 * shard  # offload: the shards on the host
            grads_opt, opt_t = (reduce_g, 0.0) if reduce_g > kept + opt_t else (kept, opt_t)
        else:
            grads_opt = 0.0 if off != "none" else grads_end
        opt = static + grads_opt + opt_t
        if fwd >= opt:
            k["gradients"], k["activations"] = g, ac
            k["comm_buffers"] += comm_t
            phase = "forward/backward"
        else:
            k["gradients"], k["optimizer"] = grads_opt, k["optimizer"] + opt_t
            phase = "optimizer step"
        row = {kk: int(vv) for kk, vv in k.items()}
        row["peak_bytes"] = sum(row[kk] for kk in KINDS)
        row["where"], row["phase"] = f"pp stage {r}", phase
        # the model state once backward is over (ZeRO's formula): fp32 weights (+ the rotary
        # buffers), gradients, AdamW's two moments (+ a 4-byte step per tensor)
        row["state"] = {"parameters": int(k["parameters"]),
                        "gradients": int(0 if off != "none" and zero >= 2 else grads_end),
                        "optimizer": int(state_opt if off == "none" else 0)}
        if off != "none":
            add_host(row, host)
        rows.append(row)
    worst = max(rows, key=lambda x: x["peak_bytes"])
    return {**worst, "per_stage": [x["peak_bytes"] for x in rows]}
