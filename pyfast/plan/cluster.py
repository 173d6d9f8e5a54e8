"""The cluster `pyfast plan` sizes for, from flags or a TOML file (flags override the file).

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


def load(path: str) -> dict:
    """The cluster file as Cluster fields (and "gpu" a Gpu); ValueError naming the problem."""
    try:
        with open(path, "rb") as f:
            t = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--cluster {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--cluster {path}: not valid TOML ({e})") from None
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
          cluster_file: str | None = None, host_ram: str | None = None) -> Cluster:
    """The Cluster of the flags over the file's values; defaults: h100, 8 GPUs a node (or all
    of them when fewer), the GPU's own intra-node link, 400 Gbit/s between nodes, the GPU's
    usual host RAM a node (hardware.py)."""
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
