"""What a plan costs: `pyfast plan --price 2.49 [--spot [D]] [--tokens 2e12]`.

The price is dollars per GPU-hour: `--price`, else the GPU type's `price` key (a [gpu] table of
the cluster file), else the file's top-level `price`. `--spot` takes the spot discount D
(a fraction off, in [0, 1): spot price = price x (1 - D)) from the flag, else the GPU type's
`spot_discount`, else the top-level one. A cluster's dollars an hour are its GPUs times their
price (every GPU of the cluster is billed: a plan runs on all of them).

Per plan (all in dollars; the same basis as the ranking, time to the target loss: a lossy
compressor's extra steps count, timing.steps_factor):
    per_step = $/hour x step_s / 3600
    per_billion_tokens = $/hour x (1e9 / tokens_per_s) x steps_factor / 3600
    to_budget = $/hour x hours_to_budget, hours_to_budget = tokens x steps_factor /
        tokens_per_s / 3600 (--tokens; null without it)
At one GPU count the fastest plan is also the cheapest (same GPUs, same price); across GPU
counts (`--scaling`) they differ, and the scaling table shows both.
"""
from __future__ import annotations

import math
from dataclasses import replace

PRICE_KEYS = ("price", "spot_discount")  # top level and in a [gpu] table of the cluster file


def check_price(v, what: str) -> float:
    """A price in $/GPU-hour: a finite number > 0, else ValueError naming `what`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what} is dollars per GPU-hour, a number > 0; got {v!r}")
    return float(v)


def check_discount(v, what: str) -> float:
    """A spot discount: a fraction off the price in [0, 1), else ValueError naming `what`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            not 0 <= v < 1:
        raise ValueError(f"{what} is the fraction off the price, in [0, 1) (0.7: spot costs "
                         f"30% of the price); got {v!r}")
    return float(v)


def table_prices(t: dict, where: str) -> dict:
    """The price keys of a cluster file's table (top level or [gpu]), checked."""
    out = {}
    if "price" in t:
        out["price"] = check_price(t["price"], f"{where}: price")
    if "spot_discount" in t:
        out["spot_discount"] = check_discount(t["spot_discount"], f"{where}: spot_discount")
    return out


def priced(gpu, top: dict):
    """The Gpu with the file's top-level price / spot_discount where its type sets none (a
    mixed cluster: apply to each node group's Gpu)."""
    kw = {k: v for k, v in top.items() if getattr(gpu, k, None) is None}
    return replace(gpu, **kw) if kw else gpu


def gpu_hour(gpu, price: float | None = None, spot: bool | float | None = None) -> float | None:
    """$/GPU-hour of one GPU of this type: --price (`price`) over the type's; spot: True (the
    type's discount) or a discount; None when no price is known anywhere."""
    p = check_price(price, "--price") if price is not None else getattr(gpu, "price", None)
    if p is None:
        if spot is not None and spot is not False:
            raise ValueError("--spot without a price: give --price $/GPU-hour (or price = ... "
                             "in the --cluster file)")
        return None
    if spot is None or spot is False:  # (identity: --spot 0 is a discount of 0, 1.0 == True)
        return p
    d = getattr(gpu, "spot_discount", None) if spot is True else check_discount(spot, "--spot")
    if d is None:
        raise ValueError(f"--spot: no spot discount for {gpu.name}: give --spot D (a fraction "
                         "off, e.g. 0.6) or spot_discount = D in the --cluster file")
    return p * (1.0 - d)


def hourly(cluster, price: float | None = None, spot: bool | float | None = None) -> float | None:
    """The cluster's dollars an hour: its GPUs x their $/GPU-hour (None: no price given)."""
    p = gpu_hour(cluster.gpu, price, spot)
    return None if p is None else cluster.gpus * p


def plan_cost(t: dict, tokens_per_step: float, dollars_per_hour: float,
              tokens: float | None = None) -> dict:
    """The cost of a plan whose predict_time dict is `t` (module doc)."""
    factor = t.get("steps_factor", 1.0)
    per_s = dollars_per_hour / 3600.0
    tps = tokens_per_step / t["step_s"]
    out = {"per_step": per_s * t["step_s"],
           "per_billion_tokens": per_s * 1e9 * factor / tps,
           "to_budget": None, "hours_to_budget": None}
    if tokens is not None:
        secs = tokens * factor / tps
        out.update(to_budget=per_s * secs, hours_to_budget=secs / 3600.0)
    return out


def check_tokens(v: float | None) -> float | None:
    if v is not None and (not math.isfinite(v) or v <= 0):
        raise ValueError(f"--tokens is a token budget, a number > 0 (e.g. 2e12); got {v!r}")
    return v


def money(x: float | None) -> str:
    """$0.0000095, $0.0123, $12.30, $1,234, $1.23M: three significant figures under $1."""
    if x is None:
        return "-"
    if 0 < x < 1:
        return f"${x:.{max(2, 2 - math.floor(math.log10(x)))}f}"
    if x >= 1e6:
        return f"${x / 1e6:,.3g}M"
    if x >= 1000:
        return f"${x:,.0f}"
    return f"${x:,.2f}"


def hours(h: float | None) -> str:
    if h is None:
        return "-"
    return f"{h / 24:,.1f} days" if h >= 48 else f"{h:,.1f} h"


def describe_price(cluster, price, spot) -> str:
    """'2.49 $/GPU-hour x 64 GPUs = $159.36/hour (spot: 60% off)'."""
    p = gpu_hour(cluster.gpu, price, spot)
    note = ""
    if spot is not None and spot is not False:
        d = cluster.gpu.spot_discount if spot is True else spot
        note = f" (spot: {d:.0%} off)"
    return f"${p:.4g}/GPU-hour x {cluster.gpus} GPUs = {money(cluster.gpus * p)}/hour{note}"
