"""The hardware the planner sizes plans for: a table of GPUs and a cluster of them.

Sources of the GPU numbers (dense, no structured sparsity; per GPU):
- h100 (SXM5): NVIDIA H100 datasheet: 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS bf16/fp16, 67 fp32
  (non-tensor); NVLink 4: 900 GB/s bidirectional, 450 GB/s each way.
- h100-hbm2e: the H100 of Meta's Grand Teton hosts that torchtitan's published runs used
  (its benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s, 500 W; its
  peak FLOP/s lie "between SXM and NVL" (835-989 TFLOPS bf16): 989 as that page's MFU uses.
- h200 (SXM): NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s, up to 700 W; compute and NVLink
  as H100 (SXM5, 700 W).
- a100-80gb / a100-40gb (SXM4): NVIDIA A100 datasheet: 312 TFLOPS bf16, 19.5 fp32; HBM2e
  2.039 TB/s (80 GB), HBM2 1.555 TB/s (40 GB); NVLink 3: 600 GB/s bidirectional.
- l40s: NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, 362 TFLOPS bf16, 91.6 fp32; no
  NVLink: PCIe 4.0 x16, 64 GB/s bidirectional.
- l4: NVIDIA L4 datasheet: 24 GB GDDR6 at 300 GB/s, 121 TFLOPS bf16 dense (242 with
  sparsity), 30.3 fp32; PCIe 4.0 x16, no NVLink; nvidia-smi reports 23034 MiB.
- rtx4090: NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090): 24 GB GDDR6X at 1008
  GB/s, 165.2 TFLOPS bf16 dense with fp32 accumulate, 82.6 fp32; PCIe 4.0 x16 and no peer-to-
  peer between GeForce cards: 25 GB/s one way through the host (an estimate); 24564 MiB.
- mi300x: AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, 1307 TFLOPS bf16, 163 fp32;
  Infinity Fabric 896 GB/s aggregate (7 peers x 128 GB/s bidirectional).
- cpu: no datasheet: `pyfast plan --measure` times this machine (its entry is a placeholder
  that --measure replaces; plans for "cpu" without it say so).

The host (offload plans, pyfast/plan/offload.py), per GPU, one way:
- pcie_bps, the GPU's host link: PCIe 5.0 x16 (h100, h200, h100-hbm2e, mi300x) is 64 GB/s
  nominal one way; 55 GB/s is what a pinned cudaMemcpy typically measures on an H100 SXM
  (NVIDIA's nvbandwidth host_to_device_memcpy_ce reports 53-56 GB/s on DGX H100; taken as 55).
  PCIe 4.0 x16 (a100, l40s, l4, rtx4090) is 32 GB/s nominal; 25 GB/s effective (pinned
  cudaMemcpy on A100 measures 24-26 GB/s: NVIDIA's bandwidthTest). An estimate where not stated.
- host_ram_per_gpu, the usual host RAM per node divided by its GPUs (the default --host-ram is
  this x --gpus-per-node): DGX H100 / DGX H200 datasheets: 2 TB for 8 GPUs (250 GB a GPU; the
  h100-hbm2e's Grand Teton hosts: assumed the same); DGX A100 datasheet: 1 TB for 8 (2 TB
  optional; 125 GB a GPU, both a100s); l40s: an 8-GPU PCIe server with 1 TB (an assumption,
  125 GB a GPU); l4: Google Cloud's G2 machine types, 48 GB a GPU (g2-standard-96: 8 L4, 384
  GB); rtx4090: a workstation with 2 of them and 128 GB (an assumption, 64 GB a GPU); mi300x:
  an 8-GPU platform with 2 TB (an assumption, as DGX H100).
- host_bps, the host memory bandwidth a GPU's share of the CPUs streams a CPU AdamW at (28
  bytes a parameter: offload.HOST_ADAMW_BYTES): a dual-socket server's 16 DDR5-4800 channels
  are 614 GB/s nominal, ~400 GB/s in STREAM, 50 GB/s for each of 8 GPUs (h100, h200, mi300x;
  an assumption); DDR4-3200 servers (a100, l40s) half that, 25 GB/s a GPU; l4 (G2's Cascade
  Lake vCPUs): 20 GB/s; a workstation's 2 DDR5 channels (~60 GB/s measured-typical) shared
  by 2 rtx4090: 30 GB/s. All assumptions: measure yours (`pyfast bench adamw`).
Memory is what the device reports (nvidia-smi's MiB for the NVIDIA parts, as the dry run's
--gpu table), so a plan's per-rank bytes are compared with what an allocator can get.
Bandwidths are stored in bytes/s one way per GPU: what a ring collective's each step moves.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

MiB, GB = 2**20, 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    flops_16: float        # dense bf16/fp16 tensor-core FLOP/s
    flops_32: float        # fp32 FLOP/s (no TF32)
    hbm_bps: float         # memory bandwidth, bytes/s
    intra_bps: float       # to a peer in the same node, one way, bytes/s
    measured: bool = False  # numbers timed on this machine (--measure), not a datasheet
    mfu: float | None = None       # fitted on published runs (below); None: MFU, assumed
    attn_mfu: float | None = None  # attention's (flash) efficiency, fitted; None: mfu's
    pcie_bps: float = 25 * GB      # the host link, one way, bytes/s (module doc)
    host_ram_per_gpu: float = 64 * GB  # the usual host RAM of a node / its GPUs (module doc)
    host_bps: float = 25 * GB      # host memory bandwidth of a GPU's share of the CPUs
    price: float | None = None          # $/GPU-hour (a cluster file's; pyfast/plan/cost.py)
    spot_discount: float | None = None  # the spot price's fraction off, in [0, 1)


# Efficiencies fitted on published runs by pyfast.plan.published.fit() (`pyfast bench
# plan_published`, bench/results/plan_published.txt; each fitted on one run, every other run
# held out): matmuls (and everything else but attention) at H100_MFU of the datasheet's bf16
# peak on torchtitan's Llama 3.1 8B, 8 H100, FSDP, seq 8,192, 5,762 tokens/s a GPU (Table 1);
# attention at H100_ATTN on its seq 32,768 run (Table 2, FSDP 8, CP 1, 3,890); A100_MFU on
# torchtitan's Llama 3 8B on 64 A100, selective op recompute, 2,973 (docs/performance.md).
# The H100 runs were at 500 W. The H200 (the same GH100 die at 700 W) gets its own factor on
# both: H200_POWER, the rate over the 500 W part's that makes Trainy's Llama 3 8B on 32 H200
# (FSDP, compile, Float8, 10,938 tokens/s a GPU; torchtitan benchmarks/llama3-8b_h200_202506_
# trainy-whitefiber.md) come out as published (with the 500 W rates: 23.8% slower), its 64-GPU
# run held out (the same configuration on twice the GPUs: a weak check). 1.34 is below the
# power ratio, 1.4. The h100 (SXM, 700 W too) keeps the 500 W rates: the factor also holds what
# differs besides power (HBM3e's 4.8 TB/s against its 3.35, on the memory-bound kernels the
# FLOP model does not count; another cluster and torch), and it rests on one run; an h100 plan
# is so pessimistic by up to that factor.
H100_MFU, H100_ATTN, A100_MFU = 0.391, 0.212, 0.595
H200_POWER = 1.344
# the host of each kind of GPU (module doc): (pcie_bps, host_ram_per_gpu, host_bps)
PCIE5 = dict(pcie_bps=55 * GB, host_ram_per_gpu=250 * GB, host_bps=50 * GB)
PCIE4 = dict(pcie_bps=25 * GB, host_ram_per_gpu=125 * GB, host_bps=25 * GB)

GPUS = {
    "h100": Gpu("h100", 81559 * MiB, 989e12, 67e12, 3.35e12, 450 * GB, mfu=H100_MFU,
                attn_mfu=H100_ATTN, **PCIE5),
    "h100-hbm2e": Gpu("h100-hbm2e", 96 * 1024 * MiB, 989e12, 67e12, 2.4e12, 450 * GB,
                      mfu=H100_MFU, attn_mfu=H100_ATTN, **PCIE5),
    "h200": Gpu("h200", 143771 * MiB, 989e12, 67e12, 4.8e12, 450 * GB,
                mfu=H200_POWER * H100_MFU, attn_mfu=H200_POWER * H100_ATTN, **PCIE5),
    "a100-80gb": Gpu("a100-80gb", 81920 * MiB, 312e12, 19.5e12, 2.039e12, 300 * GB,
                     mfu=A100_MFU, **PCIE4),
    "a100-40gb": Gpu("a100-40gb", 40960 * MiB, 312e12, 19.5e12, 1.555e12, 300 * GB,
                     mfu=A100_MFU, **PCIE4),
    "l40s": Gpu("l40s", 46068 * MiB, 362e12, 91.6e12, 864 * GB, 32 * GB, **PCIE4),
    "l4": Gpu("l4", 23034 * MiB, 121e12, 30.3e12, 300 * GB, 25 * GB, pcie_bps=25 * GB,
              host_ram_per_gpu=48 * GB, host_bps=20 * GB),
    "rtx4090": Gpu("rtx4090", 24564 * MiB, 165.2e12, 82.6e12, 1008 * GB, 25 * GB,
                   pcie_bps=25 * GB, host_ram_per_gpu=64 * GB, host_bps=30 * GB),
    "mi300x": Gpu("mi300x", 192 * 1024 * MiB, 1307e12, 163e12, 5.3e12, 448 * GB, **PCIE5),
    # placeholder: 24 GiB, 50 GFLOP/s per rank, memcpy-class bandwidths; --measure replaces it
    "cpu": Gpu("cpu", 24 * 1024 * MiB, 50e9, 50e9, 10 * GB, 2 * GB),
}

# Achieved fraction of peak FLOP/s for a GPU no published run here covers (l40s, l4, rtx4090,
# mi300x): assumed, not fitted (Megatron-LM reports 40-52% MFU on A100/H100 for 7B-175B GPTs;
# Llama 3 405B: 38-43% on H100). Measured plans (--measure, --calibrate) replace it.
MFU = 0.45
# per-message latency of a collective step: NVLink ~5 us (NCCL's small-message all-reduce
# within a DGX H100 node is ~10 us for 2 steps), InfiniBand/RoCE ~10 us, TCP ~50 us
INTRA_LATENCY_S = 5e-6
INTER_LATENCY_S = 10e-6


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: Gpu
    intra_bps: float                 # one way, per GPU, between GPUs of a node
    inter_bps: float                 # one way, per GPU (its NIC), between nodes
    intra_latency_s: float = INTRA_LATENCY_S
    inter_latency_s: float = INTER_LATENCY_S
    mfu: float = MFU
    attn_mfu: float | None = None    # attention's efficiency (timing_compute.attention_s)
    calibration: dict = field(default_factory=dict, compare=False, hash=False)
    host_ram: float = 0.0            # bytes per node (--host-ram); 0: the GPU's usual host's

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--gpus {self.gpus} and --gpus-per-node {self.gpus_per_node} "
                             "must be >= 1")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(f"--gpus {self.gpus} is not a multiple of --gpus-per-node "
                             f"{self.gpus_per_node}")

    @property
    def host_ram_bytes(self) -> float:
        """Host RAM per node: --host-ram, or the GPU type's usual (host_ram_per_gpu a GPU)."""
        return self.host_ram or self.gpu.host_ram_per_gpu * min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def within_node(self, span: int) -> bool:
        """A group whose ranks are `span` consecutive ranks stays inside one node."""
        return span <= self.gpus_per_node

    def link(self, span: int) -> tuple[float, float]:
        """(latency s, bytes/s one way) of a group spanning `span` consecutive ranks."""
        if self.within_node(span):
            return self.intra_latency_s, self.intra_bps
        return self.inter_latency_s, self.inter_bps

    def replace(self, **kw) -> "Cluster":
        return replace(self, **kw)


_UNITS = {"b/s": 1 / 8, "bit": 1 / 8, "bit/s": 1 / 8, "bps": 1 / 8, "gbit": 1e9 / 8,
          "gbit/s": 1e9 / 8, "gbps": 1e9 / 8, "mbit": 1e6 / 8, "mbit/s": 1e6 / 8,
          "mbps": 1e6 / 8, "tbit": 1e12 / 8, "gb/s": 1e9, "mb/s": 1e6, "tb/s": 1e12,
          "gib/s": 2**30, "mib/s": 2**20, "b": 1.0, "bytes/s": 1.0}


def parse_bandwidth(text: str) -> float:
    """'900GB/s', '400gbit', '100 Mbit/s', '25Gbps' -> bytes/s (bit units are /8; GB = 1e9)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z/]+)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"bandwidth {text!r}: a number and a unit, e.g. 900GB/s, 400gbit, "
                         "100mbit, 25Gbps")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"bandwidth {text!r} must be > 0")
    return value


_SIZES = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_size(text, what: str = "--host-ram") -> float:
    """'256GB', '1.5TB', '512GiB' -> bytes (GB = 1e9, GiB = 2**30); ValueError naming `what`."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and (m.group(2) or "b").lower()
    if not m or unit not in _SIZES:
        raise ValueError(f"{what} {text!r}: a number and a unit, e.g. 256GB, 1.5TB, 512GiB "
                         "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = float(m.group(1)) * _SIZES[unit]
    if value <= 0:
        raise ValueError(f"{what} {text!r} must be > 0 bytes")
    return value


def gpu(name: str) -> Gpu:
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r} is unknown; known: {', '.join(GPUS)} (or describe it "
                         "in a --cluster TOML file)")
    return GPUS[name]
