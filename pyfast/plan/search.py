"""Every `pyfast train` configuration a job can run on a cluster, scored and ranked.

A mesh dp x cp x tp x pp (product = the GPUs) is kept if the job can build it
(pyfast.train.config.check and the model's tp_check, restated here without torch): dp divides
the global batch; tp divides heads, kv heads, ffn (and the vocabulary when it is split, from
VOCAB_PARALLEL_MIN up); pp <= layers; the sequence splits into 2 x cp zigzag chunks; tp x cp
ranks (tp innermost, then cp: consecutive ranks) stay inside a node unless allowed across.
On each mesh: ZeRO 1-3 (dp x cp > 1: each tp / pp shard sharded over its dp x cp group) and,
when that group spans nodes (not under fp16), also sharded within a node only (hybrid sharding,
--zero-shard-group N: N = the group's ranks in a node, the shards all-reduced across nodes with
the compressor), the compressors (dp x cp > 1, each with error feedback; not powersgd under
ZeRO), micro-batch sizes (powers of two dividing the rank's batch; the count follows from
global = dp x micro_batch x micro_batches), the schedules when pp > 1, ring or Ulysses
attention when cp > 1, activation checkpointing on and off.

--finetune lora / qlora (finetune.py): LoRA plans instead, on dp-only meshes (mesh_plans),
each without and with --loss-chunks LOSS_CHUNKS (the LM head and fp32 loss on chunks of the
tokens: less memory, the head's forward again in backward). A chunked plan is kept only when
the same plan unchunked does not fit: it is never faster, only smaller.

When nothing fits, ZeRO's plans are scored again with host offload (--offload optimizer, and
params under ZeRO 3: offload.py), each kept if its host bytes times a node's ranks fit
cluster.host_ram_bytes (--host-ram), else rejected saying so.

Each is scored by memory.predict_memory; one over the GPU's memory is rejected with the amount
and where; the rest by timing.predict_time, ranked by time to the target loss (step_s x
steps_factor: a lossy compressor's extra steps); plans within TIE_BAND of each other are a
tie, ranked by fewer model-parallel dimensions, then less memory (prefer_simple). Pruning: a larger micro-batch
than one that does not fit is not scored (activations grow with it, everything else is equal).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .diloco import candidate
from .finetune import DEFAULT_RANK, FINETUNES, QLORA_DTYPES
from .hardware import Cluster
from .memory import predict_memory
from .spec import ModelShape, Plan, Workload, divisors, powers_of_two
from .timing import predict_time

GiB = 2**30
COMPRESSORS = ("none", "bf16", "int8", "int4", "topk:0.01", "powersgd:4")
# pyfast.train.config.SCHEDULES, 1f1b first: among equal scores the sort keeps the first
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1")
# pyfast.models.gpt.VOCAB_PARALLEL_MIN, restated so the search imports no torch (a test checks
# they are equal): from this vocabulary up, tp splits the embedding and head, so tp divides it
VOCAB_PARALLEL_MIN = 2048
MAX_STAGES, MAX_MICROBATCHES = 256, 8192  # pyfast.parallel.p2p's (tag layout)
# --loss-chunks of a chunked LoRA plan: at 8B Llama's vocabulary, 2 x 2048 tokens, the dry run's
# peak is the same at 8 and 16 (bench/results/finetune_memory.txt): one chunk's logits are then
# under a block's recompute
LOSS_CHUNKS = 8
# the offloads each ZeRO stage runs (pyfast.parallel.zero's offload=; offload.py)
OFFLOAD_KINDS = {1: ("optimizer",), 2: ("optimizer",), 3: ("optimizer", "params")}


def solo(plan) -> bool:
    """ZeRO on one GPU (dp x cp x tp x pp = 1): planned with host offload only (ZeRO-Offload),
    since without it the one rank holds every shard (no saving, the overhead). (The job also
    runs ZeRO-Offload on dp x cp = 1 with tp / pp > 1; the planner does not enumerate those.)"""
    return bool(plan.zero) and plan.dp * plan.cp * plan.tp * plan.pp == 1


# Plans whose times to the target are within this fraction of each other are a tie: the
# planner cannot tell them apart. Its error between two plans, measured on published GPU runs
# (bench/results/plan_published.txt: the ratio of two runs of one table, same model and GPUs):
# median 3.6% over the 25 pairs the model covers, 6.1% over all 35 (with the cp >= 4 pairs
# it misses); on one run's tokens/s, 7.8% (held-out median). 5%: set when these were 2.6% and
# 9.4% (session 50), between the two; kept (session 51's pair median was 5.3%).
TIE_BAND = 0.05


def mp_dims(plan) -> int:
    """How many model-parallel dimensions (cp, tp, pp) a plan splits the model over."""
    return sum(d > 1 for d in (plan.cp, plan.tp, plan.pp))


def prefer_simple(ranked: list, band: float) -> list:
    """`ranked` (fastest first) regrouped: from the fastest plan left, every plan within `band`
    of it is one tie group, ordered by fewer model-parallel dimensions, then less memory, then
    time; the next group starts at the first plan beyond the band. Each plan of a group is
    within `band` of every other (all are within it of the group's fastest)."""
    out, i = [], 0
    while i < len(ranked):
        edge = ranked[i].to_target_s * (1.0 + band)
        j = i
        while j < len(ranked) and ranked[j].to_target_s <= edge:
            j += 1
        j = max(j, i + 1)
        out += sorted(ranked[i:j], key=lambda s: (mp_dims(s.plan), s.peak, s.to_target_s))
        i = j
    return out


@dataclass
class Scored:
    plan: Plan
    memory: dict | None = None
    time: dict | None = None
    reason: str = ""             # rejected: why
    diloco: dict | None = None   # a DiLoCo candidate (plan/diloco.py): replicas, H, F, tau

    @property
    def peak(self) -> int:
        return self.memory["peak_bytes"] if self.memory else 0

    @property
    def to_target_s(self) -> float:
        return self.time["step_s"] * self.time["steps_factor"] if self.time else float("inf")

    def key(self):
        return (self.to_target_s, self.peak)


@dataclass
class Result:
    plans: list[Scored]          # fitting, best first, the top N
    rejected: list[Scored]       # examples, the fastest-if-they-fitted first
    fitting: int = 0             # plans that fit (all, not only the top N)
    memory_scored: int = 0       # predict_memory calls
    time_scored: int = 0         # predict_time calls
    pruned: int = 0              # not scored: a smaller micro-batch already did not fit
    ties: int = 0                # fitting plans left out of the top N: they score as one in it
    seconds: float = 0.0
    smallest: Scored | None = None   # the least memory of any plan scored
    mesh_problems: dict = field(default_factory=dict)  # (dp, cp, tp, pp) -> why not
    finetune: str = "full"       # the kind searched (full, lora, qlora)
    passed_over: list = field(default_factory=list)  # --finetune auto: (kind, its smallest)
    offload: str = ""            # offload plans were scored: "auto" (nothing fit without),
    # or the kind asked for
    host_short: Scored | None = None  # of the plans that fit the GPUs but not --host-ram, the
    # one needing the least host RAM

    @property
    def scored(self) -> int:
        return self.memory_scored


def meshes(gpus: int):
    """Every (dp, cp, tp, pp) with dp x cp x tp x pp = gpus."""
    for tp in divisors(gpus):
        for cp in divisors(gpus // tp):
            for pp in divisors(gpus // (tp * cp)):
                yield gpus // (tp * cp * pp), cp, tp, pp


def mesh_problem(shape: ModelShape, work: Workload, cluster: Cluster, dp: int, cp: int, tp: int,
                 pp: int, cross_node: bool = False) -> str | None:
    """Why `pyfast train` cannot run this mesh (the first reason), or None."""
    if work.global_batch % dp:
        return f"--global-batch {work.global_batch} is not divisible by dp {dp}"
    split_vocab = shape.vocab >= VOCAB_PARALLEL_MIN
    for what, n in (("heads", shape.heads), ("kv heads", shape.kv_heads), ("ffn", shape.ffn),
                    ("vocab", shape.vocab if split_vocab else tp)):
        if n % tp:
            return f"tp {tp} does not divide the {n} {what}"
    if pp > shape.layers:
        return f"pp {pp}: more pipeline stages than the {shape.layers} layers"
    if pp > 1 and shape.tied:
        return f"pp {pp} with tied embeddings (the job cannot tie weights across stages)"
    if pp > MAX_STAGES:
        return f"pp {pp}: at most {MAX_STAGES} pipeline stages"
    if cp > 1 and work.seq % (2 * cp):
        return f"cp {cp}: --seq {work.seq} does not split into 2 x cp = {2 * cp} zigzag chunks"
    span = tp * cp
    if not cross_node and cluster.gpus > cluster.gpus_per_node and \
            cluster.gpus_per_node % span:
        what = "tp" if cp == 1 else "tp x cp" if tp > 1 else "cp"
        return (f"{what} = {span} ranks would cross nodes of {cluster.gpus_per_node} GPUs "
                "(--allow-cross-node-tp allows it)")
    return None


def finetune_variants(kind: str, work: Workload, rank: int = DEFAULT_RANK) -> list[tuple]:
    """(lora rank, base dtype) of a fine-tune kind: full (0, none); lora: the base in bf16
    (under fp32 and fp16 training: as built, the training dtype); qlora: nf4 and int8."""
    if kind == "full":
        return [(0, "none")]
    if kind == "lora":
        return [(rank, "bf16" if work.precision == "bf16" else "none")]
    if kind == "qlora":
        return [(rank, d) for d in QLORA_DTYPES]
    raise ValueError(f"--finetune must be one of {', '.join(FINETUNES)}, got {kind!r}")


def node_shard_group(dp: int, cp: int, tp: int, gpus_per_node: int) -> int:
    """--zero-shard-group of a mesh whose dp x cp group spans nodes: its ranks in one node
    (the mesh's order puts tp innermost, then cp, then dp: gpus_per_node / tp of them), or 0
    when the group fits in a node or a node does not hold a whole number of its ranks."""
    n = dp * cp
    if not gpus_per_node or n * tp <= gpus_per_node or gpus_per_node % tp:
        return 0
    g = gpus_per_node // tp
    return g if 1 < g < n and n % g == 0 else 0


def mesh_plans(shape: ModelShape, work: Workload, dp: int, cp: int, tp: int, pp: int,
               finetune: list[tuple] = ((0, "none"),), gpus_per_node: int = 0):
    """The plans of one valid mesh, grouped: each group is a list ordered by micro-batch size
    (ascending), all else equal. finetune: the (lora rank, base dtype) variants
    (finetune_variants); a LoRA one on dp-only meshes, uncompressed (its adapters' gradients
    are small), each ZeRO 3 with the base replicated and sharded. gpus_per_node (a job over
    several nodes): ZeRO sharded within a node too (node_shard_group)."""
    for lora, base in finetune:
        if lora:
            if (tp, cp, pp) == (1, 1, 1):
                yield from _lora_plans(work, dp, lora, base)
        else:
            yield from _full_plans(shape, work, dp, cp, tp, pp,
                                   node_shard_group(dp, cp, tp, gpus_per_node))


def _sizes_of(rows: int) -> list[int]:
    return [b for b in powers_of_two(rows) if rows % b == 0 and rows // b < MAX_MICROBATCHES]


def _lora_plans(work: Workload, dp: int, lora: int, base: str):
    rows = work.global_batch // dp
    # dp 1: ZeRO only for offload (solo(): a shard group of one rank gains nothing without it)
    zeros = (0, 1, 2, 3) if work.precision != "fp16" else (0,)
    for zero in zeros:
        for place in ("replicate", "shard") if zero == 3 and dp > 1 else ("replicate",):
            for ac in (False, True):
                for chunks in (0, LOSS_CHUNKS):
                    group = [Plan(dp, 1, 1, 1, zero, "none", b, rows // b, "1f1b", ac, "ring",
                                  lora=lora, base_dtype=base, base_placement=place,
                                  loss_chunks=chunks)
                             for b in _sizes_of(rows)]
                    if group:
                        yield group


def _full_plans(shape: ModelShape, work: Workload, dp: int, cp: int, tp: int, pp: int,
                node_group: int = 0):
    shard = dp * cp
    # ZeRO on any mesh (fp16 too: ZeroGradScaler); on one GPU for offload only (solo())
    zeros = (0, 1, 2, 3) if shard > 1 or tp * pp == 1 else (0,)
    if work.precision == "fp16":  # ZeroGradScaler refuses a hybrid model whose cross-node
        node_group = 0  # compressor keeps feedback memory: no hybrid plans under fp16
    if pp > 1:  # under a pipeline stage 2 is stage 1: both keep the stage's gradients whole
        zeros = tuple(z for z in zeros if z != 2)  # until after it (memory.py's `piped`)
    scheds = [s for s in SCHEDULES if s != "interleaved-1f1b" or 2 * pp <= shape.layers + 2] \
        if pp > 1 else ["1f1b"]
    methods = ["ring"] + (["ulysses"] if cp > 1 and (shape.heads // tp) % cp == 0 else []) \
        if cp > 1 else ["ring"]
    rows = work.global_batch // dp
    sizes = _sizes_of(rows)
    for zero, sg in [(z, g) for z in zeros for g in ((0, node_group) if z and node_group
                                                     else (0,))]:
        for comp in COMPRESSORS if shard > 1 else ("none",):
            if zero and comp.startswith("powersgd"):
                continue
            for sched in scheds:
                if zero == 3 and sched == "zb-h1":  # the job refuses it: zb-h1's weight pass
                    continue  # runs after stage 3 freed the layer (config.check_zero)
                for method in methods:
                    for ac in (False, True):
                        group = []
                        for b in sizes:
                            m = rows // b
                            if sched == "interleaved-1f1b" and m % max(1, m // pp):
                                continue
                            group.append(Plan(dp, cp, tp, pp, zero, comp, b, m, sched, ac,
                                              method, shard_group=sg))
                        if group:
                            yield group


def search(shape: ModelShape, work: Workload, cluster: Cluster, top: int = 10,
           cross_node: bool = False, rejected: int | None = None,
           distinct: bool = True, diloco: bool = False, finetune: str = "full",
           lora_rank: int = DEFAULT_RANK, tie_band: float | None = None,
           offload: str = "auto") -> Result:
    """Score every plan (module doc); the top `top` that fit (distinct: leaving out a plan that
    scores as one already listed, to 0.1%) and up to `rejected` (default top) rejected
    examples: per mesh and ZeRO stage with nothing that fits, its smallest plan. diloco: on
    several nodes, rank a DiLoCo candidate too (plan/diloco.py; `pyfast plan` asks for it).
    finetune: full, lora or qlora (finetune_variants; auto is cli.py's: one kind after the
    other), lora_rank the adapters' rank. tie_band: plans within it of the fastest are ranked
    simplest first (prefer_simple; default TIE_BAND, 0 ranks by time alone). offload "auto":
    when no plan fits, ZeRO's plans again with --offload optimizer (and params under ZeRO 3),
    kept if one node's ranks' host bytes fit cluster.host_ram_bytes (offload.py); "none":
    never; "optimizer" / "params": only those offload plans (to compare)."""
    tie_band = TIE_BAND if tie_band is None else tie_band
    variants = finetune_variants(finetune, work, lora_rank)
    t0 = time.perf_counter()
    cap = cluster.gpu.memory_bytes
    res = Result([], [], finetune=finetune)
    fits, oom = [], {}
    # what the ranks run on: CPU ranks keep the math attention's softmax and single-tensor AdamW's
    # temporaries, GPUs flash attention and foreach AdamW (memory.py's DEVICES)
    device = "cpu" if cluster.gpu.name == "cpu" else "cuda"
    groups = []
    for dp, cp, tp, pp in meshes(cluster.gpus):
        why = mesh_problem(shape, work, cluster, dp, cp, tp, pp, cross_node)
        if why:
            res.mesh_problems[(dp, cp, tp, pp)] = why
            continue
        node = cluster.gpus_per_node if cluster.gpus > cluster.gpus_per_node else 0
        groups += mesh_plans(shape, work, dp, cp, tp, pp, variants, node)
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    host_over = {}

    def score(group):
        for i, plan in enumerate(group):
            mem = predict_memory(shape, plan, work, device)
            res.memory_scored += 1
            s = Scored(plan, mem)
            if res.smallest is None or s.peak < res.smallest.peak:
                res.smallest = s
            k = (plan.dp, plan.cp, plan.tp, plan.pp, plan.zero, plan.shard_group,
                 plan.base_dtype, plan.base_placement, plan.offload)
            if s.peak > cap:
                if k not in oom or s.peak < oom[k].peak:
                    oom[k] = s
                res.pruned += len(group) - i - 1
                break
            host = mem.get("host_bytes", 0) * per_node
            if host > cluster.host_ram_bytes:  # the same at every micro-batch size
                s.reason = (f"host RAM: {per_node} ranks x {mem['host_bytes'] / GiB:.1f} GiB = "
                            f"{host / GiB:.1f} GiB a node, over the "
                            f"{cluster.host_ram_bytes / GiB:.1f} GiB of --host-ram")
                host_over.setdefault(k, s)
                if res.host_short is None or \
                        mem["host_bytes"] < res.host_short.memory["host_bytes"]:
                    res.host_short = s
                res.pruned += len(group) - i - 1
                break
            s.time = predict_time(shape, plan, work, cluster)
            res.time_scored += 1
            fits.append(s)
    if offload not in ("auto", "none", "optimizer", "params"):
        raise ValueError(f"offload must be auto, none, optimizer or params, got {offload!r}")
    if offload in ("auto", "none"):
        for group in groups:
            if not solo(group[0]):
                score(group)
    # offload (offload.py) only when nothing fits without it (or asked for), and not on CPU
    # ranks, whose "device" is the host's memory already
    if offload in ("optimizer", "params") or (not fits and offload == "auto"):
        if device == "cpu" and offload != "auto":
            raise ValueError(f"--offload {offload} with --gpu cpu: its device is the host's "
                             "memory already, offload gains nothing there")
        res.offload = offload if device == "cuda" else ""
        for group in groups if res.offload else ():
            for kind in OFFLOAD_KINDS.get(group[0].zero, ()):
                if offload in ("auto", kind):
                    score([p.replace(offload=kind) for p in group])
    # one DiLoCo replica a node, for a slow inter-node link (full fine-tunes only)
    if diloco and cluster.nodes > 1 and finetune == "full":
        dl = candidate(shape, work, cluster, search, cross_node)
        if dl is not None:
            fits.append(dl)
    # a chunked loss only buys memory: keep a chunked plan when its unchunked twin does not fit
    plain = {s.plan for s in fits if not s.plan.loss_chunks}
    fits = [s for s in fits if not s.plan.loss_chunks or s.plan.replace(loss_chunks=0) not in plain]
    fits = prefer_simple(sorted(fits, key=Scored.key), tie_band)
    res.fitting = len(fits)
    seen = set()
    for s in fits:  # the top N distinct: a plan scoring as one listed (to 0.1%) is a tie
        k = (round(math.log(s.to_target_s) * 1000), round(math.log(max(s.peak, 1)) * 1000))
        if distinct and k in seen:
            res.ties += 1
            continue
        seen.add(k)
        res.plans.append(s)
        if len(res.plans) == top:
            break
    fitting_meshes = {(s.plan.dp, s.plan.cp, s.plan.tp, s.plan.pp, s.plan.zero,
                       s.plan.shard_group, s.plan.base_dtype, s.plan.base_placement,
                       s.plan.offload) for s in fits}
    for k, s in oom.items():
        if k in fitting_meshes or k in host_over:  # (the host is what rules it out)
            continue
        s.reason = (f"OOM by {(s.peak - cap) / GiB:.1f} GiB on {s.memory['where']} "
                    f"({s.peak / GiB:.1f} of {cap / GiB:.1f} GiB)")
        s.time = predict_time(shape, s.plan, work, cluster)
        res.rejected.append(s)
    for s in host_over.values():
        s.time = predict_time(shape, s.plan, work, cluster)
        res.rejected.append(s)
    res.rejected.sort(key=Scored.key)
    res.rejected = res.rejected[:top if rejected is None else rejected]
    res.seconds = time.perf_counter() - t0
    return res
