"""A mixed cluster: `[[nodes]]` tables of a `pyfast plan --cluster FILE.toml`, each a group of
nodes of one GPU type (pyfast/plan/mixed.py plans on it; docs/plan.md "Mixed clusters").

    inter_bw = "100gbit"         # optional: the link between the groups, one way per GPU
                                 # (default: the slowest group's NIC)
    inter_latency_us = 10        # optional: between nodes (default hardware.INTER_LATENCY_S)

    [[nodes]]                    # one table per group, in rank order (group 0's ranks first)
    count = 2                    # nodes in the group (> 0)
    gpus_per_node = 8            # (> 0)
    gpu = "a100-80gb"            # a name of pyfast.plan.hardware.GPUS, or a [gpu]-style inline
                                 # table: { base = "l40s", memory_gib = 44 } (cluster.gpu_table)
    # optional, as at a one-type file's top level (default: the GPU's):
    # name = "old"               # a label for the tables (default: the GPU's name)
    # intra_bw = "32GB/s"        # one way per GPU inside a node
    # inter_bw = "200gbit"       # this group's NIC, one way per GPU (default 400gbit)
    # intra_latency_us = 5, inter_latency_us = 10, mfu = 0.45, host_ram = "1TB"

A file with [[nodes]] takes no top-level gpus, gpus_per_node, gpu, intra_bw, ...: they are per
group. Flags that say the same (--gpus, --gpus-per-node, --gpu, --intra-bw, --host-ram) are
refused with such a file; --inter-bw sets the link between the groups. The file is read by
cluster.load_nodes; this module holds what it builds.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import INTER_LATENCY_S, Cluster

@dataclass(frozen=True)
class Group:
    """`count` nodes of `gpus_per_node` GPUs of one type; `cluster` holds the type's GPU, its
    links and efficiency as a one-type Cluster of this group alone."""
    name: str
    count: int
    gpus_per_node: int
    cluster: Cluster

    @property
    def gpus(self) -> int:
        return self.count * self.gpus_per_node


@dataclass(frozen=True)
class MixedCluster:
    """Node groups of different GPU types in one job, ranks numbered group by group (the
    order of the file's [[nodes]] tables); `inter_bps` the link between groups."""
    groups: tuple[Group, ...]
    inter_bps: float
    inter_latency_s: float = INTER_LATENCY_S

    def __post_init__(self):
        if not self.groups:
            raise ValueError("a mixed cluster needs at least one [[nodes]] group")

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    @property
    def nodes(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def mixed(self) -> bool:
        """More than one GPU type (groups of one type plan as one Cluster: homogeneous())."""
        return len({(g.cluster.gpu, g.cluster.mfu) for g in self.groups}) > 1

    def group_of(self, rank: int) -> int:
        """The group index holding global rank `rank`."""
        for i, g in enumerate(self.groups):
            if rank < g.gpus:
                return i
            rank -= g.gpus
        raise ValueError(f"rank {rank} is beyond the cluster's {self.gpus} GPUs")

    def starts(self) -> list[int]:
        """Each group's first global rank."""
        out, r = [], 0
        for g in self.groups:
            out.append(r)
            r += g.gpus
        return out

    def for_job(self, i: int) -> Cluster:
        """Group i's type as the one-type Cluster the timing model prices a rank of it with:
        its own GPUs, node size and intra-node link; between nodes the slower of its NIC and
        the link between groups (a collective over the job's ranks runs at its slowest hop);
        sized to hold every rank of the job, so that a group over more than a node crosses
        nodes as it does here."""
        c = self.groups[i].cluster
        n = c.gpus_per_node
        world = max(self.gpus, n)
        between = min(c.inter_bps, self.inter_bps) if len(self.groups) > 1 else c.inter_bps
        lat = max(c.inter_latency_s, self.inter_latency_s) if len(self.groups) > 1 \
            else c.inter_latency_s
        return replace(c, gpus=-(-world // n) * n, inter_bps=between, inter_latency_s=lat)

    def homogeneous(self) -> Cluster:
        """One type in every group, same node size: the plain Cluster (the one-type planner
        and its output, unchanged)."""
        c = self.groups[0].cluster
        sizes = {g.gpus_per_node for g in self.groups}
        if self.mixed or len(sizes) > 1:
            raise ValueError("the cluster's groups differ in GPU type or node size: it is mixed")
        return replace(c, gpus=self.gpus, inter_bps=min(self.inter_bps, c.inter_bps))

    def label(self) -> str:
        """'2 x 4 a100-80gb + 2 x 4 l40s' (nodes x GPUs a node, per group)."""
        return " + ".join(f"{g.count} x {g.gpus_per_node} {g.name}" for g in self.groups)


def any_micro_batch(zero: dict, batch: int) -> dict:
    """The measured per-step costs of DataParallel / ZeRO (calibration "zero", keyed by
    timing_zero.zero_key at one micro-batch) at every micro-batch size up to `batch`: they
    are the gradients' (hooks, reductions, the wait after backward), which a rank's share of a
    split batch does not change. Without it a split rank is priced by the arithmetic and its
    peer by the probe: gpt-small dp2 here carried 50 ms of measured hooks at b8 only, its
    b11 step predicted faster than its b8, and the split went to 13,3 (measured 1.11x, not
    the 1.83x predicted)."""
    import re
    out = dict(zero)
    for key, v in zero.items():
        m = re.fullmatch(r"(.*):b\d+(:.*)", key)
        if m:
            for b in range(1, batch + 1):
                out.setdefault(f"{m.group(1)}:b{b}{m.group(2)}", v)
    return out


def with_calibration(mc: MixedCluster, cal: dict, precision: str,
                     batch: int | None = None) -> MixedCluster:
    """Every group priced with this machine's measured numbers `cal` (pyfast plan --measure),
    its compute (and optimizer) scaled by the measured FLOP/s over the group's GPU's own
    (flops_32 under fp32, else flops_16): a group whose [gpu] table says half this machine's
    rate computes twice as long. How an emulated pair is planned (`pyfast bench plan_mixed`:
    the probes' rate plain and throttled, written into the groups' [gpu] tables). batch (the
    global batch): the measured DataParallel / ZeRO costs hold at every share of it."""
    rate = cal.get("flops_s")
    if batch and cal.get("zero"):  # a split rank's share at any size (any_micro_batch)
        cal = dict(cal, zero=any_micro_batch(cal["zero"], batch))
    if not rate:
        raise ValueError("--measure on a [[nodes]] cluster needs the probes' FLOP/s "
                         "(calibration flops_s) to scale each group's compute by")
    groups = []
    for g in mc.groups:
        c = g.cluster
        peak = c.gpu.flops_32 if precision == "fp32" else c.gpu.flops_16
        mine = dict(cal, compute_scale=cal.get("compute_scale", 1.0) * rate / peak)
        groups.append(replace(g, cluster=replace(c, calibration=mine)))
    return replace(mc, groups=tuple(groups))
