"""Published GPU training runs, and the planner's prediction of each exact configuration.

The planner's GPU step times are a datasheet FLOP rate times an efficiency (hardware.Gpu.mfu).
These are the runs that efficiency is fitted on and checked against: torchtitan's tables
(pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1-6: Llama 3.1 8B /
70B / 405B on 8-512 H100, FSDP, FSDP + CP / TP / PP; benchmarks/asyncTP_llama3_h100_2025-06
_torchtitan.md: FSDP + TP, bf16 and Float8 tensorwise, plain and AsyncTP; docs/performance.md
at 0413364: Llama 2 / 3 on 64 A100, FSDP; benchmarks/llama3-8b_h200_202506_trainy-whitefiber
.md: FSDP on 32 / 64 H200).

predict(case) evaluates the published configuration itself (model, GPUs, dp x cp x tp x pp,
batch, sequence, recompute), not the planner's best: FSDP is ZeRO 3 gathering bf16 weights
(param_compress bf16; fp8 where the run all-gathers float8), one micro-batch a rank (torchtitan
accumulates none). Under pp, as torchtitan 9dec370 (the commit Tables 1-6 name) runs it:
  - the local batch in pp micro-batches (torchtitan/parallelisms/pipelining_utils.py:
    n_microbatches defaults to pipeline_parallel_degree; later torchtitan defaults to
    micro-batches of 1 sequence), 2 stages a rank for interleaved 1F1B (generate_split_points);
  - FSDP keeps each stage's gathered bf16 weights over the micro-batches
    (parallelize_llama.py: reshard_after_forward=False under PP): Plan.keep_gathered.
What the planner's models have no switch for is applied here, each from a stated source:
- selective recompute: torchtitan's "op" policy saves SDPA's output and every other matmul's
  (torchtitan/models/llama3/parallelize.py, _save_list and the mm count), so a block recomputes
  half its matmuls' forward; its "layer" policy checkpoints every 2nd block (ac_freq 2). Time
  and activations are interpolated between the models' recompute off and on by that fraction.
- torch.compile and Float8 linears: factors on the FLOP rate, fitted on Table 1's rows (FIT)
  and held out everywhere else. Float8 "rowwise" rows (a different recipe) are left out.
- AsyncTP: Plan.async_tp, each TP collective overlapped with its matmul (timing_tp.py); no
  constant is fitted on those rows.
Published memory is the caching allocator's peak reserved memory; the model predicts the peak
allocated by pyfast's own job, which keeps fp32 checkpoints and LayerNorm outputs (torchtitan's
are bf16); TP cases run with --sequence-parallel, as torchtitan's TP always does. Under pp the
stage's gradients are held whole over the micro-batches (pyfast's job does so, as FSDP under
torch's pipelining schedules: issue 33 added it to the memory model, the 405B rows' predicted
memory rose by 15 GiB, toward the published). Before the two pp settings above (micro-batches of
1 sequence, weights regathered) the 405B 1F1B row was +20.3% in tokens/s and -56% in memory, the
interleaved one -43% in memory. bench/results/plan_published.txt names the gap per case.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import GPUS, H200_POWER, Cluster, parse_bandwidth
from .memory import predict_memory
from .shapes import preset
from .spec import Plan, Workload
from .timing import predict_time

GiB = 2**30
RECOMPUTE = ("none", "full", "selective-op", "selective-layer")
TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
ATP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
A100 = "torchtitan docs/performance.md (64 A100 80GB)"
H200 = "torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    model: str            # a shapes preset
    gpu: str              # a hardware.GPUS name
    dp: int
    cp: int
    tp: int
    pp: int
    local_batch: int      # sequences a dp rank takes per step
    seq: int
    recompute: str        # RECOMPUTE
    tps: float            # published tokens/s a GPU
    memory_gib: float | None = None
    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    schedule: str = "1f1b"
    inter_bw: str = "400gbit"   # Grand Teton: 400 Gb/s RDMA a GPU (the page)
    fp8_gather: bool = False
    microbatches: int | None = None   # under pp; None: torchtitan 9dec370's default, pp

    @property
    def compiled_loss(self) -> bool:
        """torchtitan compiles the loss under --training.compile from bbb1b616e (2025-04-02:
        components/loss.py build_cross_entropy_loss; the AsyncTP page's 820504e and Trainy's
        e7c0cae have it); 9dec370 (Tables 1-6) left it eager (train.py: "compiling loss
        function causes CUDA errors"): Plan.fused_loss."""
        return self.compile and self.source in (ATP, H200)

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp


def _c(name, src, model, gpu, mesh, lb, seq, rc, tps, mem=None, **kw) -> Case:
    return Case(name, src, model, gpu, *mesh, lb, seq, rc, tps, mem, **kw)


H = "h100-hbm2e"
CASES = (
    _c("T1 FSDP", TT + " Table 1", "llama-8b", H, (8, 1, 1, 1), 2, 8192, "selective-op",
       5762, 82.4),
    _c("T1 FSDP+compile", TT + " Table 1", "llama-8b", H, (8, 1, 1, 1), 2, 8192,
       "selective-op", 6667, 77.0, compile=True),
    _c("T1 FSDP+compile+Float8", TT + " Table 1", "llama-8b", H, (8, 1, 1, 1), 2, 8192,
       "selective-op", 8532, 76.8, compile=True, float8=True),
    *(_c(f"T2 FSDP {8 // cp}, CP {cp}", TT + " Table 2", "llama-8b", H, (8 // cp, cp, 1, 1),
         1, seq, "full", tps, mem, compile=True, float8=True)
      for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2),
                                (4, 131072, 1071, 84.0), (8, 262144, 548, 84.5))),
    _c("T3 FSDP 128", TT + " Table 3", "llama-8b", H, (128, 1, 1, 1), 2, 8192, "selective-op",
       5605, 67.0),
    _c("T3 FSDP 128+compile", TT + " Table 3", "llama-8b", H, (128, 1, 1, 1), 2, 8192,
       "selective-op", 6514, 62.0, compile=True),
    _c("T3 FSDP 128+compile+Float8", TT + " Table 3", "llama-8b", H, (128, 1, 1, 1), 2, 8192,
       "selective-op", 8380, 61.8, compile=True, float8=True),
    _c("T4 70B FSDP 32 x TP 8", TT + " Table 4", "llama-70b", H, (32, 1, 8, 1), 16, 8192,
       "full", 829, 71.9, compile=True, float8=True),
    _c("T4 70B FSDP 32 x TP 8 AsyncTP", TT + " Table 4", "llama-70b", H, (32, 1, 8, 1), 16,
       8192, "full", 876, 67.6, compile=True, float8=True, async_tp=True),
    _c("T5 405B 1F1B", TT + " Table 5", "llama-405b", H, (8, 1, 8, 8), 32, 8192, "full", 100,
       82.5, compile=True, float8=True, async_tp=True),
    _c("T5 405B interleaved 1F1B", TT + " Table 5", "llama-405b", H, (8, 1, 8, 8), 32, 8192,
       "full", 128, 72.7, compile=True, float8=True, async_tp=True,
       schedule="interleaved-1f1b"),
    *(_c(f"T6 405B FSDP {8 // cp}, CP {cp}", TT + " Table 6", "llama-405b", H,
         (8 // cp, cp, 8, 8), 8, seq, "full", tps, mem, compile=True, float8=True,
         async_tp=True)
      for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9),
                                (4, 131072, 31, 77.1), (8, 262144, 16, 84.9))),
    _c("ATP 70B FSDP 32 x TP 8 bf16", ATP, "llama-70b", H, (32, 1, 8, 1), 16, 8192, "full",
       597.3, compile=True),
    _c("ATP 70B FSDP 32 x TP 8 bf16 AsyncTP", ATP, "llama-70b", H, (32, 1, 8, 1), 16, 8192,
       "full", 652.4, compile=True, async_tp=True),
    _c("ATP 70B ... Float8 tensorwise", ATP, "llama-70b", H, (32, 1, 8, 1), 16, 8192, "full",
       809.8, compile=True, float8=True),
    _c("ATP 70B ... Float8 tensorwise AsyncTP", ATP, "llama-70b", H, (32, 1, 8, 1), 16, 8192,
       "full", 942.4, compile=True, float8=True, async_tp=True),
    _c("ATP 8B FSDP 8 x TP 8 bf16", ATP, "llama-8b", H, (8, 1, 8, 1), 12, 8192,
       "selective-op", 4378, compile=True),
    _c("ATP 8B FSDP 8 x TP 8 bf16 AsyncTP", ATP, "llama-8b", H, (8, 1, 8, 1), 12, 8192,
       "selective-op", 4809.4, compile=True, async_tp=True),
    _c("ATP 8B ... Float8 tensorwise", ATP, "llama-8b", H, (8, 1, 8, 1), 12, 8192,
       "selective-op", 5078.1, compile=True, float8=True),
    _c("ATP 8B ... Float8 tensorwise AsyncTP", ATP, "llama-8b", H, (8, 1, 8, 1), 12, 8192,
       "selective-op", 5570.1, compile=True, float8=True, async_tp=True),
    # the A100 page names no network: 400 Gb/s a GPU assumed, as the H100 runs' (at 200 Gb/s
    # the model makes these FSDP backwards communication-bound and the fit needs 73% MFU)
    *(_c(f"A100 {name}", A100, model, "a100-80gb", (64, 1, 1, 1), lb, seq, rc, tps)
      for name, model, lb, seq, rc, tps in (
          ("Llama 3 8B, selective op", "llama-8b", 1, 8192, "selective-op", 2973),
          ("Llama 3 8B, selective layer", "llama-8b", 1, 8192, "selective-layer", 2904),
          ("Llama 3 70B, full", "llama-70b", 1, 8192, "full", 331),
          ("Llama 2 13B, no recompute", "llama-13b", 2, 4096, "none", 2162),
          ("Llama 2 13B, selective layer", "llama-13b", 2, 4096, "selective-layer", 1914),
          ("Llama 2 13B, selective op", "llama-13b", 2, 4096, "selective-op", 1904),
          ("Llama 2 70B, selective op", "llama-2-70b", 1, 4096, "selective-op", 355),
          ("Llama 2 70B, full", "llama-2-70b", 2, 4096, "full", 353))),
    *(_c(f"H200 FSDP {n}+compile+Float8", H200, "llama-8b", "h200", (n, 1, 1, 1), 2, 8192,
         "selective-op", tps, mem, compile=True, float8=True, fp8_gather=True)
      for n, tps, mem in ((32, 10938, 47.96), (64, 10753, 46.97))),
)
# what each constant is fitted on (everything else is held out): the GPU's efficiency on its
# eager bf16 FSDP run, compile and Float8 on Table 1's next two rows; attention's efficiency on
# Table 2's run without CP (32,768 tokens: attention is 36% of its FLOPs, 12% at 8,192); the
# 700 W H200's rate over the 500 W H100's (matmuls and attention alike: POWER) on Trainy's
# 32-GPU run, its 64-GPU run held out
FIT = {"mfu h100-hbm2e": "T1 FSDP", "mfu a100-80gb": "A100 Llama 3 8B, selective op",
       "compile": "T1 FSDP+compile", "float8": "T1 FSDP+compile+Float8",
       "attn h100-hbm2e": "T2 FSDP 8, CP 1", "power h200": "H200 FSDP 32+compile+Float8"}
# the same silicon: the efficiencies fitted on one stand for the other's, times POWER
SAME_DIE = {"h100": "h100-hbm2e", "h200": "h100-hbm2e", "a100-40gb": "a100-80gb"}
# a 700 W part's every tensor-core kernel over the 500 W one's of its die (hardware.py says why
# h100, 700 W too, does not take h200's)
POWER = {"h200": H200_POWER}


def case(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise ValueError(f"no published case {name!r}; known: {', '.join(c.name for c in CASES)}")


def op_sac_fraction(shape, seq_local: int) -> float:
    """The share of a block's forward FLOPs torchtitan's op-level SAC recomputes: every other
    matmul (attention, SDPA, is saved): half the matmul FLOPs over the block's (matmuls +
    causal attention over seq_local / 2 keys on average)."""
    mm = 2.0 * shape.layer_matmul_params()
    return 0.5 * mm / (mm + 2.0 * shape.hidden * seq_local)


def op_sac_kept(shape) -> float:
    """The share of a Llama block's saved activation bytes (bf16, per token) that op-level SAC
    keeps: the block input, SDPA's output and every other matmul output, against what no
    recompute keeps (2 norms' input and output, q/k/v and their rotated q, k, SDPA's output,
    the SwiGLU's w1, w3, silu and product outputs)."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn
    none = 4 * h + (h + 2 * kv) + (h + kv) + h + 4 * f
    kept = h + (3 * h + 2 * kv + 2 * f) / 2 + h
    return kept / none


def recompute_share(c: Case, shape) -> tuple[float, float]:
    """(share of the full recompute's extra time, share of no recompute's extra activations)."""
    if c.recompute == "none":
        return 0.0, 1.0
    if c.recompute == "full":
        return 1.0, 0.0
    if c.recompute == "selective-layer":
        return 0.5, 0.5
    # the full recompute reruns the whole block forward: op SAC's share of that
    return op_sac_fraction(shape, c.seq // c.cp), op_sac_kept(shape)


def cluster_of(c: Case, fitted: dict | None = None) -> Cluster:
    """The case's cluster: the GPU's fitted efficiencies (`fitted` over hardware.py's), the
    matmul rate scaled by torch.compile's and Float8's factors; attention's is neither's."""
    g = GPUS[c.gpu]
    f = fitted or {}
    die = SAME_DIE.get(c.gpu, c.gpu)
    mfu = f.get(f"mfu {die}", GPUS[die].mfu)
    if mfu is None:
        raise ValueError(f"--gpu {c.gpu} has no fitted efficiency: pass fitted['mfu {die}']")
    power = f.get(f"power {c.gpu}", POWER.get(c.gpu, 1.0))
    mfu, attn = power * mfu, power * (f.get(f"attn {die}", GPUS[die].attn_mfu) or mfu)
    scale = (f.get("compile", COMPILE) if c.compile else 1.0) * \
        (f.get("float8", FLOAT8) if c.float8 else 1.0)
    return Cluster(c.gpus, min(8, c.gpus), g, g.intra_bps, parse_bandwidth(c.inter_bw),
                   mfu=mfu * scale, attn_mfu=attn)


def plan_of(c: Case, ac: bool) -> tuple[Plan, Workload]:
    if c.recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {c.recompute!r}")
    m = (c.microbatches or c.pp) if c.pp > 1 else 1
    if c.local_batch % m:
        raise ValueError(f"{c.name}: local batch {c.local_batch} does not split into {m} "
                         "micro-batches")
    zero = 3 if c.dp * c.cp > 1 else 0
    plan = Plan(c.dp, c.cp, c.tp, c.pp, zero=zero,
                micro_batch=c.local_batch // m, micro_batches=m, schedule=c.schedule,
                activation_checkpointing=ac,
                param_compress="fp8" if c.fp8_gather else "bf16",
                # torchtitan's TP always shards the norms' regions (SequenceParallel styles,
                # models/llama3/parallelize.py): pyfast train --sequence-parallel
                sequence_parallel=c.tp > 1, async_tp=c.async_tp,
                keep_gathered=zero == 3 and c.pp > 1, fused_loss=c.compiled_loss)
    return plan, Workload(c.seq, c.dp * c.local_batch, "bf16")


def predict(c: Case, fitted: dict | None = None) -> dict:
    """The model's tokens/s a GPU and peak memory (GiB) of the published configuration."""
    shape = preset(c.model)
    cl = cluster_of(c, fitted)
    t_share, a_share = recompute_share(c, shape)
    out = {}
    for ac in (False, True):
        plan, work = plan_of(c, ac)
        out[ac] = (predict_time(shape, plan, work, cl)["step_s"],
                   predict_memory(shape, plan, work)["peak_bytes"])
    (t0, m0), (t1, m1) = out[False], out[True]
    step = t0 + t_share * (t1 - t0)
    mem = m1 + a_share * (m0 - m1)
    tokens = c.dp * c.local_batch * c.seq
    return {"tps": tokens / step / c.gpus, "memory_gib": mem / GiB, "step_s": step}


def _solve(c: Case, key: str, fitted: dict) -> float:
    """The value of fitted[key] that makes predict(c) give the published tokens/s (bisection
    in log space: tokens/s rises with the rate)."""
    lo, hi = 0.01, 4.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        if predict(c, {**fitted, key: mid})["tps"] < c.tps:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


def fit(rounds: int = 4) -> dict:
    """Each constant of FIT from its case, in order (compile and float8 on top of the GPU's),
    `rounds` times over: the matmul and attention efficiencies each move the other's case
    (4 rounds: the constants settle to 1e-4)."""
    fitted = {}
    for _ in range(rounds):
        for key, name in FIT.items():
            fitted[key] = _solve(case(name), key, fitted)
    return fitted


# Fitted by fit() (bench/results/plan_published.txt; tests/test_plan_published.py checks
# fit() reproduces them): torch.compile's and Float8's rate over eager bf16 on torchtitan's
# Table 1 (8B, 8 H100, FSDP)
COMPILE = 1.217
FLOAT8 = 1.434


def with_gpu_fit(fitted: dict) -> dict:
    """GPUS with each fitted mfu in place (what hardware.py's table states): a GPU's own, or
    its die's times its POWER."""
    def mfu(k, g):
        if f"mfu {k}" in fitted:
            return fitted[f"mfu {k}"]
        if k in POWER and f"mfu {SAME_DIE[k]}" in fitted:
            return fitted.get(f"power {k}", POWER[k]) * fitted[f"mfu {SAME_DIE[k]}"]
        return g.mfu
    return {k: replace(g, mfu=mfu(k, g)) for k, g in GPUS.items()}
