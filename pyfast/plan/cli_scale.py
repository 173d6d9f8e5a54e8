"""`pyfast plan`'s scaling and cost flags: --scaling COUNTS (scaling.py: one search a GPU count),
--price / --spot / --tokens (cost.py: each plan's dollars, the cheapest and the fastest count
side by side). cli.py parses and calls these; this words them."""
from __future__ import annotations

import json
import sys

from . import cost
from . import scaling as S


def add_flags(p) -> None:
    g = p.add_argument_group("scaling and cost (docs/plan.md \"Scaling\", \"Cost\")")
    g.add_argument("--scaling", metavar="N,N,...", help="plan at each GPU count (e.g. "
                   "8,16,32,64; instead of --gpus): the best plan's step, tokens/s and scaling "
                   "efficiency, strong (this --global-batch) and weak (the batch grown with the "
                   "GPUs from the first count's), and what each point loses to")
    g.add_argument("--price", type=float, metavar="DOLLARS", help="$ per GPU-hour (over the "
                   "cluster file's price keys): each plan's cost a step, per billion tokens "
                   "and to --tokens")
    g.add_argument("--spot", nargs="?", const=True, type=float, metavar="D",
                   help="spot prices: the price x (1 - D); D from the flag, else the cluster "
                   "file's spot_discount")
    g.add_argument("--tokens", type=float, metavar="N", help="a token budget (e.g. 2e12): "
                   "the dollars and the wall time to train on it")


def check_cost(ns, cl=None) -> None:
    """The cost flags (a price given in the cluster file is checked when it is read); with the
    cluster `cl`, that a price and a discount are known where --spot / --tokens need them."""
    if ns.price is not None:
        cost.check_price(ns.price, "--price")
    if ns.spot is not None and ns.spot is not True:
        cost.check_discount(ns.spot, "--spot")
    cost.check_tokens(ns.tokens)
    if cl is not None and cost.gpu_hour(cl.gpu, ns.price, ns.spot) is None and ns.tokens:
        raise ValueError(f"--tokens {ns.tokens:g}: give --price to cost it")


def _hourly(ns, cl):
    return cost.hourly(cl, ns.price, ns.spot)


def cost_of(ns, seq: int):
    """(Scored, cluster, global_batch) -> its cost dict, or None when no price is known."""
    def f(s, cl, global_batch):
        h = _hourly(ns, cl)
        return None if h is None else cost.plan_cost(s.time, global_batch * seq, h, ns.tokens)
    return f


def priced_rows(ns, plans, shape, work, cl, row) -> list[dict]:
    """row(s, shape, work, cl) (cli.row) of each plan, with "cost" (dollars: per_step,
    per_billion_tokens, to_budget, hours_to_budget) when a price is known."""
    h = _hourly(ns, cl)
    out = []
    for s in plans:
        d = row(s, shape, work, cl)
        if h is not None:
            d["cost"] = cost.plan_cost(s.time, work.tokens, h, ns.tokens)
        out.append(d)
    return out


def print_cost(ns, plans, work, cl, console) -> None:
    """The cost of the listed plans, a line each (nothing without a price)."""
    h = _hourly(ns, cl)
    if h is None:
        return
    console.print(f"cost at {cost.describe_price(cl, ns.price, ns.spot)} (the fastest plan "
                  "is the cheapest at one GPU count; --scaling compares counts):")
    for i, s in enumerate(plans, 1):
        c = cost.plan_cost(s.time, work.tokens, h, ns.tokens)
        line = f"  #{i}: {cost.money(c['per_step'])} a step, " \
               f"{cost.money(c['per_billion_tokens'])} per billion tokens"
        if c["to_budget"] is not None:
            line += f", {cost.money(c['to_budget'])} and {cost.hours(c['hours_to_budget'])} " \
                    f"to {ns.tokens:.3g} tokens"
        console.print(line)


def _counts(ns) -> list[int]:
    if ns.gpus is not None:
        raise ValueError(f"--scaling {ns.scaling} gives the GPU counts: leave out --gpus")
    if ns.verify:
        raise ValueError("--verify with --scaling: dry-run one count's plans with --gpus N "
                         "--verify")
    from .cluster import load
    f = load(ns.cluster) if ns.cluster else {}
    # a count above one node must fill whole nodes (build's default: 8 GPUs a node)
    return S.parse_counts(ns.scaling, ns.gpus_per_node or f.get("gpus_per_node") or 8)


def scaling_main(ns, inputs, plan_finetune, nothing_fits, row) -> int:
    """`pyfast plan --scaling`: cli.py's own steps passed in (inputs, plan_finetune,
    nothing_fits, row), each count searched as `pyfast plan --gpus N` would."""
    from .render import describe
    from .spec import Workload
    try:
        check_cost(ns)
        counts = _counts(ns)
        ns.gpus = counts[-1]
        shape, work, cl = inputs(ns)  # measured or refit once, for every count
        check_cost(ns, cl)

        def best(n: int, global_batch: int):
            c = cl.replace(gpus=n, gpus_per_node=min(cl.gpus_per_node, n))
            w = Workload(ns.seq, global_batch, ns.precision)
            res = plan_finetune(shape, w, c, ns)
            return (res.plans[0], c) if res.plans else (None, nothing_fits(res, shape, w, c))
        rows = S.scale(counts, ns.global_batch, lambda gb: gb * ns.seq, best)
    except (ValueError, FileNotFoundError) as e:
        print(f"pyfast plan: error: {e}", file=sys.stderr)
        return 2
    priced = cost.gpu_hour(cl.gpu, ns.price, ns.spot) is not None
    cost_f = cost_of(ns, ns.seq) if priced else None
    pair = S.cheapest_fastest(rows, cost_f) if priced else None
    if ns.json:
        out = {"scaling": S.json_rows(rows, lambda s, c: row(s, shape, work, c), cost_f)}
        for name, r in zip(("cheapest", "fastest"), pair or ()):
            out[name] = {"gpus": r["gpus"], "efficiency": r["efficiency"],
                         "command": row(r["best"], shape, work, r["cluster"])["command"],
                         "cost": cost_f(r["best"], r["cluster"], r["global_batch"])}
        print(json.dumps(out))
        return 0
    from rich.console import Console
    console = Console(width=200)
    console.print(f"[bold]{shape.name}[/]: {shape.params() / 1e9:.3g}B parameters on "
                  f"{', '.join(map(str, counts))} x {cl.gpu.name} ({min(cl.gpus_per_node, counts[-1])} "
                  f"a node), --seq {ns.seq} --global-batch {ns.global_batch} {ns.precision}; weak "
                  f"scaling: global batch {ns.global_batch} x GPUs / {counts[0]}")
    S.render(rows, console, describe, cost_f)
    if pair:
        _side_by_side(pair, cost_f, console, describe, ns)
    return 0


def _side_by_side(pair, cost_f, console, describe, ns) -> None:
    from rich.table import Table
    cheap, fast = pair
    t = Table(title="the cheapest and the fastest GPU count: "
              + cost.describe_price(cheap["cluster"], ns.price, ns.spot).split(" x ")[0])
    for c in ("", "GPUs", "plan", "step s", "tokens/s", "efficiency", "$/B tokens",
              "to budget", "time to budget"):
        t.add_column(c, justify="left" if c in ("", "plan") else "right")
    for name, r in (("cheapest", cheap), ("fastest", fast)):
        c = cost_f(r["best"], r["cluster"], r["global_batch"])
        t.add_row(name, str(r["gpus"]), describe(r["best"]), f"{r['step_s']:.3g}",
                  f"{r['tokens_per_s']:,.0f}", f"{r['efficiency']:.1%}",
                  cost.money(c["per_billion_tokens"]), cost.money(c["to_budget"]),
                  cost.hours(c["hours_to_budget"]))
    console.print(t)
    if cheap is fast:
        console.print(f"note: {fast['gpus']} GPUs is both the cheapest and the fastest count")
    else:
        a = cost_f(cheap["best"], cheap["cluster"], cheap["global_batch"])["per_billion_tokens"]
        b = cost_f(fast["best"], fast["cluster"], fast["global_batch"])["per_billion_tokens"]
        sp = (cheap["step_s"] * cheap["steps_factor"]) / (fast["step_s"] * fast["steps_factor"])
        console.print(f"note: {fast['gpus']} GPUs trains {sp:.2f}x as fast as {cheap['gpus']} "
                      f"for {b / a - 1:+.0%} the dollars per token (efficiency "
                      f"{fast['efficiency']:.0%} vs {cheap['efficiency']:.0%})")
