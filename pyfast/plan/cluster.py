"""The cluster `pyfast plan` sizes for, from flags or a TOML file (flags override the file).
A file with [[nodes]] tables is a mixed cluster of several GPU types instead (nodes.py has its
format; load_nodes below reads it).

A cluster file (every key optional but gpus and a gpu):

    gpus = 64
    gpus_per_node = 8
    gpu = "h100"                 # a name of pyfast.plan.hardware.GPUS, or a [gpu] table:
    # [gpu]
    # base = "h100"              # start from a known GPU (optional), then override:
    # memory_gib = 80            # memory per GPU, GiB
    # flops_16 = 989e12          # dense bf16/fp16 FLOP/s
    # flops_32 = 67e12           # fp32 FLOP/s
    # hbm = "3.35TB/s"           # or hbm_bps = 3.35e12 (bytes/s)
    # intra_bw = "450GB/s"       # to a peer in the node, one way
    intra_bw = "450GB/s"         # one way per GPU inside a node (default: the GPU's)
    inter_bw = "400gbit"         # one way per GPU between nodes (its NIC)
    intra_latency_us = 5         # per collective step inside a node
    inter_latency_us = 10        # between nodes
    mfu = 0.45                   # achieved fraction of peak FLOP/s
    host_ram = "256GB"           # host RAM per node (default: the GPU's usual host's)
    price = 2.49                 # $/GPU-hour (pyfast/plan/cost.py; --price overrides)
    spot_discount = 0.6          # spot's fraction off the price, in [0, 1) (--spot)
    # [gpu] takes price and spot_discount too: that GPU type's, over the top level's
    # [gpu] also takes pcie_bw (the host link, one way) and host_bw (a GPU's share of the
    # host's memory bandwidth), as hbm
"""
from __future__ import annotations

import tomllib
from dataclasses import replace

from . import cost
from .hardware import GPUS, Cluster, Gpu, gpu, parse_bandwidth, parse_size
from .nodes import Group, MixedCluster

NODE_KEYS = {"count", "gpus_per_node", "gpu", "name", "intra_bw", "inter_bw", "intra_latency_us",
             "inter_latency_us", "mfu", "host_ram"}
# the keys a [[nodes]] file may have at its top level (the rest are per group)
MIXED_TOP_KEYS = {"nodes", "inter_bw", "inter_latency_us"}
# flags of `pyfast plan` that describe one GPU type: refused with a [[nodes]] file
CONFLICTING_FLAGS = {"gpus": "--gpus", "gpus_per_node": "--gpus-per-node", "gpu": "--gpu",
                     "intra_bw": "--intra-bw", "host_ram": "--host-ram"}
DEFAULT_INTER = "400gbit"  # InfiniBand NDR per GPU (a DGX H100's 8 x 400 Gbit/s ConnectX-7)
TOP_KEYS = {"gpus", "gpus_per_node", "gpu", "intra_bw", "inter_bw", "intra_latency_us",
            "inter_latency_us", "mfu", "host_ram", *cost.PRICE_KEYS}
GPU_KEYS = {"base", "name", "memory_gib", "flops_16", "flops_32", "hbm", "hbm_bps", "intra_bw",
            "pcie_bw", "host_bw", *cost.PRICE_KEYS}


def _bw(value, what: str) -> float:
    """A bandwidth: a string with a unit ('400gbit') or a number of bytes/s."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{what} must be > 0, got {value}")
        return float(value)
    try:
        return parse_bandwidth(value)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _positive(t: dict, key: str, where: str) -> float:
    v = t[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{where}: {key} must be a number > 0, got {v!r}")
    return float(v)


def gpu_table(t: dict, path: str) -> Gpu:
    """A [gpu] table: `base` (a known GPU) overridden by the keys given; without a base,
    memory_gib, flops_16, flops_32, hbm (or hbm_bps) and intra_bw are all needed."""
    where = f"{path} [gpu]"
    bad = set(t) - GPU_KEYS
    if bad:
        raise ValueError(f"{where}: unknown keys {sorted(bad)}; known: {sorted(GPU_KEYS)}")
    if "base" in t:
        g = gpu(t["base"])
    else:
        need = {"memory_gib", "flops_16", "flops_32", "intra_bw"} - set(t)
        if not {"hbm", "hbm_bps"} & set(t):
            need.add("hbm")
        if need:
            raise ValueError(f"{where}: without base = \"h100\" (or another known GPU) it needs "
                             f"memory_gib, flops_16, flops_32, hbm and intra_bw; missing "
                             f"{', '.join(sorted(need))}")
        g = Gpu(t.get("name", "custom"), 0, 0.0, 0.0, 0.0, 0.0)
    kw = {}
    if "name" in t:
        kw["name"] = str(t["name"])
    if "memory_gib" in t:
        kw["memory_bytes"] = int(_positive(t, "memory_gib", where) * 2**30)
    for k in ("flops_16", "flops_32"):
        if k in t:
            kw[k] = _positive(t, k, where)
    if "hbm" in t or "hbm_bps" in t:
        kw["hbm_bps"] = _bw(t.get("hbm", t.get("hbm_bps")), f"{where} hbm")
    if "intra_bw" in t:
        kw["intra_bps"] = _bw(t["intra_bw"], f"{where} intra_bw")
    for k in ("pcie_bw", "host_bw"):
        if k in t:
            kw[k.replace("_bw", "_bps")] = _bw(t[k], f"{where} {k}")
    kw.update(cost.table_prices(t, where))
    return replace(g, **kw)


def read(path: str) -> dict:
    """The cluster file parsed; ValueError naming it when it cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--cluster {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--cluster {path}: not valid TOML ({e})") from None


def load(path: str) -> dict:
    """The cluster file as Cluster fields (and "gpu" a Gpu); ValueError naming the problem."""
    t = read(path)
    if "nodes" in t:
        raise ValueError(f"--cluster {path} has [[nodes]] groups (a mixed cluster): this "
                         "path plans one GPU type (--scaling is not planned on mixed clusters "
                         "yet)")
    bad = set(t) - TOP_KEYS
    if bad:
        raise ValueError(f"--cluster {path}: unknown keys {sorted(bad)}; known: "
                         f"{sorted(TOP_KEYS)}")
    out = {}
    for k in ("gpus", "gpus_per_node"):
        if k in t:
            if not isinstance(t[k], int) or isinstance(t[k], bool):
                raise ValueError(f"--cluster {path}: {k} must be an integer, got {t[k]!r}")
            out[k] = t[k]
    if "gpu" in t:
        out["gpu"] = gpu_table(t["gpu"], path) if isinstance(t["gpu"], dict) else gpu(t["gpu"])
    for k in ("intra_bw", "inter_bw"):
        if k in t:
            out[k.replace("_bw", "_bps")] = _bw(t[k], f"--cluster {path}: {k}")
    for k in ("intra_latency_us", "inter_latency_us"):
        if k in t:
            out[k.replace("_us", "_s")] = _positive(t, k, f"--cluster {path}") * 1e-6
    if "host_ram" in t:
        out["host_ram"] = parse_size(t["host_ram"], f"--cluster {path}: host_ram")
    out["prices"] = cost.table_prices(t, f"--cluster {path}")  # build() applies them
    if "mfu" in t:
        out["mfu"] = _positive(t, "mfu", f"--cluster {path}")
        if out["mfu"] > 1:
            raise ValueError(f"--cluster {path}: mfu is a fraction of peak (<= 1), got "
                             f"{out['mfu']}")
    return out


def build(gpus: int | None = None, gpus_per_node: int | None = None, gpu_name: str | None = None,
          intra_bw: str | None = None, inter_bw: str | None = None,
          cluster_file: str | None = None, host_ram: str | None = None):
    """The Cluster of the flags over the file's values; defaults: h100, 8 GPUs a node (or all
    of them when fewer), the GPU's own intra-node link, 400 Gbit/s between nodes, the GPU's
    usual host RAM a node (hardware.py). A file with [[nodes]] groups (nodes.py): a
    MixedCluster, or the plain Cluster when every group has one GPU type and node size (its
    plans and output are then the one-type planner's)."""
    if cluster_file and "nodes" in read(cluster_file):
        return build_nodes(cluster_file, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu_name,
                           intra_bw=intra_bw, host_ram=host_ram, inter_bw=inter_bw)
    f = load(cluster_file) if cluster_file else {}
    if host_ram is not None:
        f["host_ram"] = parse_size(host_ram)
    if gpus is not None:
        f["gpus"] = gpus
    if "gpus" not in f:
        raise ValueError("give the number of GPUs: --gpus N (or gpus = N in --cluster FILE)")
    if gpus_per_node is not None:
        f["gpus_per_node"] = gpus_per_node
    f.setdefault("gpus_per_node", min(8, f["gpus"]))
    if gpu_name is not None:
        f["gpu"] = gpu(gpu_name)
    g = f["gpu"] = cost.priced(f.get("gpu", GPUS["h100"]), f.pop("prices", {}))
    if g.mfu is not None:  # the GPU's efficiency fitted on published runs (hardware.py)
        f.setdefault("mfu", g.mfu)
    if g.attn_mfu is not None:
        f.setdefault("attn_mfu", g.attn_mfu)
    if intra_bw is not None:
        f["intra_bps"] = _bw(intra_bw, "--intra-bw")
    f.setdefault("intra_bps", g.intra_bps)
    if inter_bw is not None:
        f["inter_bps"] = _bw(inter_bw, "--inter-bw")
    f.setdefault("inter_bps", parse_bandwidth(DEFAULT_INTER))
    return Cluster(**f)  # its own check: gpus a multiple of gpus_per_node


def build_nodes(path: str, inter_bw: str | None = None, **flags):
    """A [[nodes]] file (nodes.load_nodes) with the flags that may go with it: the one-type
    flags (flags: gpus, gpus_per_node, gpu, intra_bw, host_ram) refused by name, --inter-bw
    the link between groups. One type throughout: the plain Cluster."""
    refuse_flags(path, **flags)
    mc = load_nodes(read(path), path)
    if inter_bw is not None:
        mc = replace(mc, inter_bps=_bw(inter_bw, "--inter-bw"))
    try:
        return mc.homogeneous()
    except ValueError:
        return mc


# ---- [[nodes]]: a mixed cluster (nodes.py)
def _int(t: dict, key: str, where: str) -> int:
    v = t[key]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{where}: {key} must be an integer > 0, got {v!r}")
    return v


def load_nodes(t: dict, path: str) -> MixedCluster:
    """The [[nodes]] tables of a parsed cluster file; ValueError naming the file, the table
    (its index) and the key."""
    top = f"--cluster {path}"
    bad = set(t) - MIXED_TOP_KEYS
    if bad:
        raise ValueError(f"{top}: {sorted(bad)} at the top level of a file with [[nodes]]: "
                         f"set them in each [[nodes]] table (top-level keys with [[nodes]]: "
                         f"{sorted(MIXED_TOP_KEYS - {'nodes'})})")
    tables = t["nodes"]
    if not isinstance(tables, list) or not tables or \
            not all(isinstance(x, dict) for x in tables):
        raise ValueError(f"{top}: nodes must be one or more [[nodes]] tables, got {tables!r}")
    groups = []
    for i, n in enumerate(tables):
        where = f"{top} [[nodes]] #{i + 1}"
        unknown = set(n) - NODE_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: "
                             f"{sorted(NODE_KEYS)}")
        missing = {"count", "gpus_per_node", "gpu"} - set(n)
        if missing:
            raise ValueError(f"{where}: missing {', '.join(sorted(missing))} (each [[nodes]] "
                             "table needs count, gpus_per_node and gpu)")
        count, per = _int(n, "count", where), _int(n, "gpus_per_node", where)
        g = n["gpu"]
        try:
            g = gpu_table(g, where) if isinstance(g, dict) else gpu(g)
        except ValueError as e:
            raise ValueError(f"{where}: gpu: {e}" if not str(e).startswith(where) else str(e)) \
                from None
        kw = {}
        for k in ("intra_bw", "inter_bw"):
            if k in n:
                kw[k.replace("_bw", "_bps")] = _bw(n[k], f"{where}: {k}")
        for k in ("intra_latency_us", "inter_latency_us"):
            if k in n:
                kw[k.replace("_us", "_s")] = _positive(n, k, where) * 1e-6
        if "host_ram" in n:
            kw["host_ram"] = parse_size(n["host_ram"], f"{where}: host_ram")
        if "mfu" in n:
            kw["mfu"] = _positive(n, "mfu", where)
            if kw["mfu"] > 1:
                raise ValueError(f"{where}: mfu is a fraction of peak (<= 1), got {kw['mfu']}")
        elif g.mfu is not None:
            kw["mfu"] = g.mfu
        if g.attn_mfu is not None:
            kw["attn_mfu"] = g.attn_mfu
        kw.setdefault("intra_bps", g.intra_bps)
        kw.setdefault("inter_bps", parse_bandwidth(DEFAULT_INTER))
        name = str(n.get("name", g.name))
        groups.append(Group(name, count, per, Cluster(count * per, per, g, **kw)))
    between = _bw(t["inter_bw"], f"{top}: inter_bw") if "inter_bw" in t else \
        min(g.cluster.inter_bps for g in groups)
    lat = _positive(t, "inter_latency_us", top) * 1e-6 if "inter_latency_us" in t else \
        max(g.cluster.inter_latency_s for g in groups)
    return MixedCluster(tuple(groups), between, lat)


def refuse_flags(path: str, **flags) -> None:
    """ValueError naming the flags given that a [[nodes]] file sets per group."""
    given = [CONFLICTING_FLAGS[k] for k, v in flags.items() if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)} with --cluster {path}: its [[nodes]] tables give "
                         "each group's GPUs, GPU type, node link and host RAM; set them there "
                         "(--inter-bw, the link between groups, is allowed)")
