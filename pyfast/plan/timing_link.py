"""The links of the time model (pyfast.plan.timing): seconds of a collective on a group of
ranks, from a fitted cost.LinkModel (calibration) or the alpha-beta ring model, with a
namespace's token bucket and the wake-up of a blocking wait."""
from __future__ import annotations

import math

from .hardware import Cluster

SMALL_BYTES = 16.0
FIT_WORLD = 2  # the ranks a fitted link was measured on (calibrate_link's probes: 2 gloo ranks)


class Link:
    """seconds(prim, nbytes one rank contributes) on a group of `world` ranks: a fitted
    cost.LinkModel (calibration) or the alpha-beta ring model of (latency, bytes/s)."""

    def __init__(self, cluster: Cluster, span: int, world: int):
        self.world = world
        lat, bw = cluster.link(span)
        self.fit = cluster.calibration.get("link_intra" if cluster.within_node(span)
                                           else "link_inter")
        self.lat, self.bw = lat, bw
        self.scale = cluster.calibration.get("comm_scale", 1.0)
        # a blocking wait that follows compute: waking the waiting thread (calibrate.wake_seconds)
        self.table = (self.fit or {}).get("wake_s") if world > 1 else None
        self.set_fit(self.fit, cluster.calibration.get("link_cpu"))
        # bytes the bucket regains in a step (predict_time's 2nd pass); None: no wait for the
        # rate at all (the 1st pass: the step's time with the link at wire speed)
        self.refill = None

    def set_fit(self, fit, base=None) -> None:
        """A fit with "tbf": [rate bytes/s, burst bytes] is a token-bucket link (the
        namespaces' tc tbf, calibrate.probe_link): its bytes pass at wire speed (`base`: the
        loopback fit's slope) while the bucket has tokens, and at the rate beyond them."""
        self.fit = fit
        self.tbf = (fit or {}).get("tbf") if base is not None else None
        self.base = base
        if self.tbf and self.table is not None:  # waking a thread is the machine's, not the link's
            self.table = base.get("wake_s", self.table)

    def grow(self, prim: str) -> tuple[float, float]:
        """(latency, bytes) multipliers taking a fit measured on FIT_WORLD ranks to this
        group's W: a ring's steps (W-1) and bytes a rank (all-reduce and all-to-all (W-1)/W of
        the data, all-gather (W-1) contributions) over the fit's. 2 ranks: (1, 1), as fitted.
        Without it 4 ranks on this machine's loopback exposed 46 ms of gpt-small's all-reduce
        against 94 measured (bench/results/scaling.txt)."""
        w, w0 = self.world, FIT_WORLD
        if w <= w0 or prim == "p2p":
            return 1.0, 1.0
        steps = (w - 1) / (w0 - 1)
        part = ((w - 1) / w) / ((w0 - 1) / w0)
        return steps, {"all_reduce": part, "all_to_all": part, "all_gather": steps,
                       "small": 1.0}[prim]

    def wire_bytes(self, prim: str, nbytes: float) -> float:
        """Bytes all ranks put on one shared link for a call (a namespace's lo: both
        directions cross one qdisc): ring all-reduce 2(W-1) n, all-gather W(W-1) n,
        all-to-all (W-1) n, p2p n."""
        w = self.world
        return {"all_reduce": 2 * (w - 1), "all_gather": w * (w - 1), "all_to_all": w - 1,
                "p2p": 1}[prim] * nbytes

    def _bucket_s(self, prim: str, nbytes: float, calls: float) -> float:
        """One of `calls` calls of a step on a token bucket of rate R and burst B: the call as
        on loopback (the `base` fit: tbf passes packets untouched while it has tokens; the
        shaped probe's own 256 B calls came out 0.2-1.9 ms from one probe to the next against
        0.25 on loopback, and gpt-tiny's pp2 stepped in 29 ms on loopback, 1 Gbit/s and
        100 Mbit/s alike), and the bytes beyond the call's tokens at R. A call's tokens: its share
        of what the bucket regains while the step computes (refill / calls: the step's calls
        come spread over it), at most B. gpt-tiny at 100 Mbit/s (12.5 MB/s, B 512 KiB):
        pp2's 8 transfers of 32 KB in a 29 ms step get 45 KB each, pass free (measured 29 ms
        as on loopback); tp2's 8 all-reduces of 131 KB (262 KB on the wire) get 47 KB and
        wait 17 ms each: 168 ms predicted, 166 measured."""
        key = "all_reduce" if prim == "p2p" else prim
        a, b, free = self.base["fits"][key]
        b = b / (2 if prim == "p2p" else 1)
        ga, gb = self.grow(prim)
        # the loopback call exactly as seconds() prices it on loopback (its fit's free bytes
        # shared by the step's calls): a shaped link then adds only what waits for the rate
        # (gpt-tiny's tp2 stepped 18.6-19.2 ms at 1 Gbit/s and 19.1-19.6 on loopback; pricing
        # the call here without the free bytes added 3.4 ms a step in one of three runs)
        t = a * ga + b * gb * max(0.0, nbytes - free / max(calls, 1.0))
        rate, burst = self.tbf
        if self.refill is None:
            return t
        tokens = min(burst, self.refill / max(calls, 1.0))
        return t + max(0.0, self.wire_bytes(prim, nbytes) - tokens) / rate

    def wake(self, after_s: float) -> float:
        """Extra seconds of a blocking wait after `after_s` of compute (the calibration's
        table, interpolated linearly in log(after_s), held at its ends)."""
        t = self.table
        if not t:
            return 0.0
        if after_s <= t[0][0]:
            return self.scale * t[0][1]
        for (x0, y0), (x1, y1) in zip(t, t[1:]):
            if after_s <= x1:
                u = math.log(after_s / x0) / math.log(x1 / x0)
                return self.scale * (y0 + u * (y1 - y0))
        return self.scale * t[-1][1]

    def seconds(self, prim: str, nbytes: float, calls: float = 1.0) -> float:
        """One of `calls` such calls a step makes: a token-bucket link's `free` bytes (its
        burst, refilled while the step computes) are shared by the step's calls: gpt-tiny's
        tp2 at 100 Mbit/s makes 8 all-reduces of 131 KB about 0.5 ms apart, measured 166 ms
        a step = its 2.1 MB at the rate, not 8 x 131 KB let through free."""
        if self.world <= 1:
            return 0.0
        w = self.world
        if self.fit is not None:
            if prim == "small":
                return self.scale * (self.base if self.tbf else self.fit)["small_s"] * \
                    self.grow("small")[0]
            if self.tbf:
                return self.scale * self._bucket_s(prim, nbytes, calls)
            a, b, free = self.fit["fits"]["all_reduce" if prim == "p2p" else prim]
            # p2p: one rank sends nbytes; a 2-rank all-reduce of nbytes puts 2 x nbytes on
            # the (shared) link, both ranks sending half of it twice
            b = b / 2 if prim == "p2p" else b
            ga, gb = self.grow(prim)
            return self.scale * (a * ga + b * gb * max(0.0, nbytes - free / max(calls, 1.0)))
        calls, moved = {"all_reduce": (2 * (w - 1), 2 * (w - 1) / w * nbytes),
                        "all_gather": (w - 1, (w - 1) * nbytes),
                        "all_to_all": (w - 1, (w - 1) / w * nbytes),
                        "p2p": (1, nbytes), "small": (2 * (w - 1), 0.0)}[prim]
        return self.scale * (calls * self.lat + moved / self.bw)


def _cpu_link(cluster: Cluster, world: int) -> "Link":
    """The link whose seconds are a collective's CPU work (calibration's link_cpu)."""
    link = Link(cluster, 1, world)
    link.set_fit(cluster.calibration.get("link_cpu"))
    return link
