"""How a job scales: `pyfast plan --scaling 8,16,32,...` plans the model at each GPU count and
reports the best plan's predicted step, tokens/s and scaling efficiency, strong and weak, with
the cause of each point's loss from the planner's own time model (timing.predict_time).

Strong scaling: the same --global-batch at every count. Weak scaling: the global batch grows
with the GPUs from the smallest count's, global_batch x gpus / gpus_0 (sequences per GPU held;
a count where that is not a whole number of sequences has no weak point, saying so).

Efficiency is per-GPU throughput relative to the smallest count's (the first count with a plan
that fits), on the ranking's basis, time to the target loss (a lossy compressor's extra steps
count: timing.steps_factor):
    c_N = step_N x steps_factor_N x N / tokens_N      (GPU-seconds a token at N GPUs)
    efficiency_N = c_0 / c_N
The loss, 1 - efficiency, is split by the parts of the step (predict_time's keys), each part k
as GPU-seconds a token x_k = seconds_k x N / tokens (extra steps: (steps_factor - 1) x step):
    loss_k = (x_k at N - x_k at N_0) / c_N,  so sum_k loss_k = 1 - efficiency_N exactly
parts: exposed_comm (communication compute does not hide, ZeRO's gathers and DiLoCo's outer
step included), bubble (the pipeline's), recompute (activation checkpointing: the search takes
it only when memory forces it, as it is never faster), optimizer (AdamW and the norm pass: a
replicated optimizer's seconds do not shrink with more GPUs), extra_steps (a compressor's) and
rest (compute: replicated embedding/head, smaller matmuls, host offload). A part can be
negative: a gain over the smallest count (e.g. ZeRO sharding the optimizer).
"""
from __future__ import annotations

PARTS = ("exposed_comm", "bubble", "recompute", "optimizer", "extra_steps", "rest")
NAMES = {"exposed_comm": "exposed comm", "extra_steps": "extra steps"}


def parse_counts(text: str, gpus_per_node: int | None = None) -> list[int]:
    """'8,16,32' -> [8, 16, 32]; ValueError on a count <= 0, not an integer, unsorted or
    repeated, or above one node and not a multiple of gpus_per_node."""
    try:
        counts = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--scaling {text!r}: GPU counts, comma-separated integers, e.g. "
                         "8,16,32") from None
    bad = [n for n in counts if n <= 0]
    if bad:
        raise ValueError(f"--scaling {text}: GPU counts must be >= 1, got {bad}")
    for a, b in zip(counts, counts[1:]):
        if b <= a:
            raise ValueError(f"--scaling {text}: counts must be increasing, without repeats "
                             f"({a} then {b})")
    if gpus_per_node:
        odd = [n for n in counts if n > gpus_per_node and n % gpus_per_node]
        if odd:
            raise ValueError(f"--scaling {text}: {odd} span several nodes but are not a "
                             f"multiple of --gpus-per-node {gpus_per_node}")
    return counts


def weak_batch(global_batch: int, n0: int, n: int) -> int | None:
    """The weak-scaling global batch at n GPUs (module doc); None when not whole."""
    gb = global_batch * n
    return gb // n0 if gb % n0 == 0 else None


def parts(t: dict) -> dict:
    """Seconds a step of each part (PARTS); they sum to step x steps_factor."""
    step = t["step_s"]
    out = {"exposed_comm": t.get("exposed_comm_s", 0.0), "bubble": t.get("bubble_s", 0.0),
           "recompute": t.get("recompute_s", 0.0), "optimizer": t.get("optimizer_s", 0.0),
           "extra_steps": (t.get("steps_factor", 1.0) - 1.0) * step}
    out["rest"] = step - sum(out[k] for k in PARTS[:4])
    return out


def per_token(t: dict, gpus: int, tokens: int) -> dict:
    """GPU-seconds a token of each part."""
    return {k: v * gpus / tokens for k, v in parts(t).items()}


def point(t: dict, gpus: int, tokens: int, base: dict | None) -> dict:
    """efficiency and loss of one count against `base` (per_token of the base count, or None:
    this is the base)."""
    x = per_token(t, gpus, tokens)
    c = sum(x.values())
    if base is None:
        return {"efficiency": 1.0, "loss": {k: 0.0 for k in PARTS}}
    c0 = sum(base.values())
    return {"efficiency": c0 / c, "loss": {k: (x[k] - base[k]) / c for k in PARTS}}


def scale(counts: list[int], global_batch: int, tokens_of, best) -> list[dict]:
    """The scaling rows. best(gpus, global_batch) -> (Scored, cluster) of the best plan, or
    (None, reason); tokens_of(global_batch) -> tokens a step."""
    rows, base, wbase, n0 = [], None, None, None
    for n in counts:
        s, cl = best(n, global_batch)
        r = {"gpus": n, "global_batch": global_batch}
        if s is None:
            r.update(step_s=None, tokens_per_s=None, efficiency=None, reason=cl)
            rows.append(r)
            continue
        tok = tokens_of(global_batch)
        pt = point(s.time, n, tok, base)
        if base is None:
            base, n0 = per_token(s.time, n, tok), n
        r.update(step_s=s.time["step_s"], tokens_per_s=s.time["tokens_per_s"],
                 steps_factor=s.time.get("steps_factor", 1.0), **pt, best=s, cluster=cl)
        gb = weak_batch(global_batch, n0, n)
        if gb is None:
            r.update(weak_efficiency=None, weak={"reason": f"{global_batch} x {n} / {n0} is not "
                                                 "a whole number of sequences"})
        else:
            ws, wcl = (s, cl) if gb == global_batch else best(n, gb)
            if ws is None:
                r.update(weak_efficiency=None, weak={"global_batch": gb, "reason": wcl})
            else:
                wtok = tokens_of(gb)
                wpt = point(ws.time, n, wtok, wbase)
                if wbase is None:
                    wbase = per_token(ws.time, n, wtok)
                r.update(weak_efficiency=wpt["efficiency"],
                         weak={"global_batch": gb, "step_s": ws.time["step_s"],
                               "tokens_per_s": ws.time["tokens_per_s"], "loss": wpt["loss"],
                               "best": ws, "cluster": wcl})
        rows.append(r)
    return rows


def _loss_text(loss: dict) -> str:
    """The parts that move a tenth of a point or more, largest first, in efficiency points
    (percentage points): 'exposed comm +12.0, optimizer +1.3'."""
    big = sorted(((v, k) for k, v in loss.items() if abs(v) >= 0.001), reverse=True)
    return ", ".join(f"{NAMES.get(k, k)} {100 * v:+.1f}" for v, k in big) or "-"


def render(rows: list[dict], console, describe, cost_of=None) -> None:
    """The strong and the weak table; cost_of(Scored, cluster, global_batch) -> cost dict
    (cost.plan_cost) adds cost columns."""
    from rich.table import Table
    from .cost import hours, money
    t = Table(title="scaling: the best plan at each GPU count (efficiency: per-GPU throughput "
              "to the target loss vs the first count; loss: what each part costs, in "
              "percentage points of efficiency)")
    money_cols = ("$/step", "$/B tokens", "to budget") if cost_of else ()
    for c in ("GPUs", "best plan", "step s", "tokens/s", "strong eff", "strong loss",
              "weak batch", "weak step s", "weak eff", "weak loss") + money_cols:
        t.add_column(c, justify="left" if c in ("best plan", "strong loss", "weak loss")
                     else "right")
    for r in rows:
        if r["step_s"] is None:
            t.add_row(str(r["gpus"]), f"nothing: {r['reason']}"[:160], *["-"] * (8 + len(
                money_cols)))
            continue
        w = r["weak"]
        money_cells = ()
        if cost_of:
            c = cost_of(r["best"], r["cluster"], r["global_batch"])
            money_cells = (money(c["per_step"]), money(c["per_billion_tokens"]),
                           f"{money(c['to_budget'])}, {hours(c['hours_to_budget'])}"
                           if c["to_budget"] is not None else "-")
        t.add_row(str(r["gpus"]), describe(r["best"]), f"{r['step_s']:.3g}",
                  f"{r['tokens_per_s']:,.0f}", f"{r['efficiency']:.1%}", _loss_text(r["loss"]),
                  str(w.get("global_batch", "-")),
                  f"{w['step_s']:.3g}" if "step_s" in w else "-",
                  f"{r['weak_efficiency']:.1%}" if r["weak_efficiency"] is not None else "-",
                  _loss_text(w["loss"]) if "loss" in w else w.get("reason", "-")[:80],
                  *money_cells)
    console.print(t)


def json_rows(rows: list[dict], row_of, cost_of=None) -> list[dict]:
    """The rows as `--json`'s "scaling": gpus, global_batch, step_s, tokens_per_s, efficiency,
    loss, weak_efficiency, weak {global_batch, step_s, tokens_per_s, loss}, the best "plan"
    (row_of(Scored, cluster): cli.row's dict), and "cost" where priced."""
    out = []
    for r in rows:
        d = {k: r.get(k) for k in ("gpus", "global_batch", "step_s", "tokens_per_s",
                                   "efficiency")}
        if r["step_s"] is None:
            d["reason"] = r["reason"]
            out.append(d)
            continue
        d["steps_factor"] = r["steps_factor"]
        d["loss"] = r["loss"]
        d["weak_efficiency"] = r["weak_efficiency"]
        d["weak"] = {k: v for k, v in r["weak"].items() if k not in ("best", "cluster")}
        d["plan"] = row_of(r["best"], r["cluster"])
        if cost_of:
            d["cost"] = cost_of(r["best"], r["cluster"], r["global_batch"])
        out.append(d)
    return out


def cheapest_fastest(rows: list[dict], cost_of) -> tuple[dict, dict] | None:
    """The strong rows' cheapest (per billion tokens) and fastest (tokens/s to the target)."""
    ok = [r for r in rows if r["step_s"] is not None]
    if not ok:
        return None
    fast = min(ok, key=lambda r: r["step_s"] * r["steps_factor"])
    cheap = min(ok, key=lambda r: cost_of(r["best"], r["cluster"],
                                          r["global_batch"])["per_billion_tokens"])
    return cheap, fast
