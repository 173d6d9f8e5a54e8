"""ZeRO's reduce-scatters and parameter all-gathers in the time model (pyfast.plan.timing)."""
from __future__ import annotations

from .sharding import hybrid_compressors
from .spec import Plan, Workload
from .hardware import Cluster
from .timing_link import Link
from .timing_reduce import DENSE_BYTES, _buckets, _codec, _fifo, gathered_bytes, reduction_s


def zero_key(plan: Plan, work: Workload) -> str:
    """The calibration key of ZeRO's measured per-step costs (calibrate_dist.zero_probe) for
    this plan's stage, compressor and local shape."""
    return f"zero{plan.zero}:{plan.compress}:b{plan.micro_batch}:s{work.seq}:{work.precision}"


def _zero(plan: Plan, mods: list, link: Link, cluster: Cluster, body: float,
          mod_s, frozen: list | None = None, replica: Link | None = None) -> tuple[float, float]:
    """(comm seconds, exposed seconds) of ZeRO's reduce-scatters and parameter all-gathers
    over `link` (the shard group). Reduce-scatter of n elements ~ an all-to-all of its
    (compressed) buffer; stage 3's all-gathers carry param_compress's payload, stages 1-2's
    exact fp32 after the step. replica: hybrid sharding's link across the replicas (the
    nodes): behind each unit's reduce-scatter, its shard's all-reduce there, compressed by
    --compress (memory.hybrid_compressors; the reduce-scatter in the node exact).
    Under a pipeline (pp > 1) the reduce-scatters run after the stage's last backward, after
    the pipeline (memory.py's `piped`): nothing hides them."""
    w = link.world
    rs_spec, rep_spec = hybrid_compressors(plan)
    if plan.compress.startswith("powersgd"):
        raise ValueError(f"--zero {plan.zero} with --compress {plan.compress}: the job's "
                         "reduce-scatter takes a compressor that works on a shard, not powersgd")
    name, _, arg = rs_spec.partition(":")
    piped = plan.pp > 1
    # top-k/random-k select within each rank's segment: value + index per kept element
    gbytes = 4.0 if name == "none" else 8.0 * float(arg) if name in ("topk", "randomk") \
        else DENSE_BYTES[name]
    pbytes = gathered_bytes(plan)

    # memoized by size: a model's blocks are one size, its buckets few (a 16-GPU gpt-7b search
    # called these 720K times each, for ~40 distinct sizes a plan)
    memo: dict = {}

    def rs(n):
        if ("rs", n) not in memo:
            enc, dec = _codec(rs_spec, n, cluster)
            out = link.seconds("all_to_all", gbytes * n) + enc + dec
            if replica is not None:  # the shard's all-reduce across the replicas, behind it
                out += reduction_s(rep_spec, -(-n // w), (), replica, cluster)[0]
            memo[("rs", n)] = out
        return memo[("rs", n)]

    def ag(n, by):
        if (by, n) not in memo:
            enc, dec = _codec("none" if by == 4.0 else plan.param_compress, n / w, cluster)
            memo[(by, n)] = link.seconds("all_gather", by * n / w) + enc + w * dec
        return memo[(by, n)]

    if plan.zero < 3:
        bks = _buckets(mods, False)
        red = [rs(n) for n, _, _ in bks]
        gat = sum(ag(n, 4.0) for n, _, _ in bks)
        if plan.zero == 1 or piped:  # at the step / after the pipeline: nothing to hide behind
            return sum(red) + gat, sum(red) + gat
        # stage 2: as DataParallel's buckets during the last backward (ready ~ evenly spread)
        bwd = [mod_s(k, ps) for k, ps in mods]
        tb = sum(x[1] + x[2] for x in bwd)
        t, done = body - tb, {}
        for i in reversed(range(len(mods))):
            t += bwd[i][1] + bwd[i][2]
            done[i] = t
        end = _fifo([done[i] for _, _, i in bks], red)
        return sum(red) + gat, max(0.0, end - body) + gat
    # stage 3: one unit per module; gathers one ahead of compute on the FIFO, forward and
    # backward, reduce-scatters behind each unit's backward. A unit's gather is posted when the
    # unit before it starts, its reduce-scatter when it ends: so on the FIFO the next unit's
    # gather goes ahead of this one's reduce-scatter (queued as `pending`, posted after it).
    # Posting them the other way round serialized backward: 8B Llama on 128 H100 at 400 Gbit/s
    # lost 31% to exposed communication where torchtitan's FSDP loses 3% (5,605 tokens/s a GPU
    # on 128, 5,762 on 8: bench/results/plan_published.txt)
    units = [sum(n for n, _ in ps) for _, ps in mods]
    times = [mod_s(k, ps) for k, ps in mods]
    base = frozen or [0.0] * len(units)
    # per unit, the same every micro-batch: its gather, and per phase the wait's wake-up and
    # the compute (computed once: the loop below ran them per micro-batch, 88% of a 128-GPU
    # 7B search's time once ZeRO 3 ran under pipelines of up to 1,024 micro-batches)
    gs = [ag(u, pbytes) + (link.seconds("all_gather", b / w) if b else 0.0)
          for u, b in zip(units, base)]
    prev = [[times[i - 1][ph] if i else 0.0 for i in range(len(units))] for ph in (0, 1)]
    wakes = [[link.wake(x) for x in prev[ph]] for ph in (0, 1)]
    dur = [[x[0] for x in times], [x[1] + x[2] for x in times]]
    order = (list(range(len(units))), list(reversed(range(len(units)))))

    # plan.keep_gathered: a stage's units stay gathered from the first micro-batch's forward
    # to the last backward (FSDP2's reshard_after_forward=False under PP): one gather a unit
    keep = plan.keep_gathered
    none = [0.0] * len(units)

    def micro(t, comm_free, last, first):
        pending, rs_sum = None, 0.0
        for phase in (0, 1):
            g = none if keep and (phase or not first) else gs
            for i in order[phase]:
                comm_free = max(comm_free, t - prev[phase][i]) + g[i]
                gathered = comm_free
                if pending is not None:
                    comm_free = max(comm_free, pending[0]) + pending[1]
                    pending = None
                # the unit waits on its gather's handle: a blocking wait after the last unit
                t = max(t, gathered) + wakes[phase][i] + dur[phase][i]
                if phase == 1 and last and not piped:
                    rsi = rs(units[i])
                    rs_sum += rsi
                    pending = (t, rsi)
        return t, comm_free, pending, rs_sum

    m = plan.micro_batches
    t = comm_free = 0.0
    k, gap, at = 0, None, None
    while k < m - 1:
        t, comm_free, _, _ = micro(t, comm_free, False, k == 0)
        k += 1
        # max-plus arithmetic: once a micro-batch leaves t and the FIFO the same distance apart
        # as the one before, every later one shifts both by the same step (exact)
        if gap is not None and abs((t - comm_free) - gap) <= 1e-12 * max(1.0, t):
            step = t - at
            t, comm_free, k = t + step * (m - 1 - k), comm_free + step * (m - 1 - k), m - 1
            break
        gap, at = t - comm_free, t
    t, comm_free, pending, rs_sum = micro(t, comm_free, True, m == 1)
    total = (1 if keep else 2 * m) * sum(gs) + rs_sum
    if pending is not None:
        comm_free = max(comm_free, pending[0]) + pending[1]
    if piped:  # after the pipeline, once the units' gathers are done
        after = sum(rs(u) for u in units)
        total += after
        t = max(t, comm_free) + after
    comp = plan.micro_batches * sum(x[0] + x[1] + x[2] for x in times)
    return total, max(0.0, max(t, comm_free) - comp)
