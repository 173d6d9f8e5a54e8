"""Plans for this machine, measured rather than assumed: `pyfast plan --measure` (measure) and
`pyfast plan --calibrate RUNDIR` (refit).

Keys of Cluster.calibration (all optional; pyfast.plan.timing reads them):
    "compute": {timing.compute_key(kind, plan, work): [forward_s, backward_s]} one micro-batch
        through one module (kind embed | block | head, the head with its loss; a block key
        ending ":cp": a cp plan's block timed on cp ranks, its loopback traffic included) at
        the plan's local shape (tp's shards, seq/cp tokens, micro_batch sequences, the
        precision's autocast; a checkpointed block's backward includes its recompute), 1
        thread per rank as `pyfast train --nproc N` runs (torchrun: OMP_NUM_THREADS=1)
    "flops_s": the blocks' measured FLOP/s (median), for shapes not measured
    "optim_s_per_param": AdamW step + the job's gradient-norm pass, seconds per parameter
        (timed on the whole model, so the CPU loop's per-tensor cost is spread as in the job)
    "copy_s_per_byte": a 16 MB tensor copy (DataParallel's reduced buckets back into .grad)
    "link_cpu": the loopback link's model: the CPU time of a collective's copies
    "step_overhead_s": a step of the job beyond modules + optimizer (measure_job)
    "cpu_contention": 1.0 on a CPU "cluster" (this machine): the communication thread's CPU
        work (codec + link_cpu) is not hidden behind compute on cores the ranks already fill
    "compute" keys ending ":dist": a tp plan's block timed on tp ranks (calibrate_dist)
    "zero": {timing_zero.zero_key(plan, work): [fwd_bwd_extra_s, step_extra_s]}: ZeRO's cost
        beyond a plain local step of the same model, 2 ranks on loopback (calibrate_dist);
        stage 0 (DataParallel) adds a third: its wait alone (the rest is its hooks' CPU)
    "codec": {spec: [enc_a, enc_b, dec_a, dec_b]}: encode/decode seconds = a + b x elements
        (pyfast.comm.cost.codec_seconds at two sizes)
    "link_intra", "link_inter": {"fits": {primitive: [alpha, beta, free]}, "small_s": s,
        "wake_s": [[work_s, extra_s], ...], "tbf": [rate_bytes_s, burst_bytes],
        "reduce": {spec: [a, b, vector_s]} (reduce_seconds: top-k's / PowerSGD's call a
        parameter)}, a
        pyfast.comm.cost.LinkModel fitted by measure_link on 2 gloo ranks ("link": its name),
        wake_seconds' table, and on a namespace-shaped link its token bucket (probe_link)
    "pp": {timing.pp_key(plan): s}: the pipeline runtime's own seconds a micro-batch and
        virtual stage (sends, headers, the outcome, Python between actions) on pp gloo ranks
        on loopback (calibrate_dist.pp_probe)
    "compute_scale", "comm_scale": refit's measured / predicted (multipliers on the above)
"""
from __future__ import annotations

from .hardware import Cluster
from .spec import ModelShape, Plan, Workload
# the probes, by concern; their names stay importable from here (cli, benchmarks, tests)
from .calibrate_compute import measure_codecs, measure_compute, measure_cp_blocks  # noqa: F401
from .calibrate_dist import measure_pp, measure_tp_blocks, measure_zero
from .calibrate_job import measure_job
from .calibrate_link import measure_loopback_link, probe_link, reduce_seconds  # noqa: F401
from .refit import refit, refit_records, run_plan, shape_of  # noqa: F401


def default_plans(shape: ModelShape, work: Workload, world: int = 2) -> list[Plan]:
    out = []
    for tp in (1, world):
        for cp in (1, world):
            if tp * cp <= world and work.global_batch % (world // (tp * cp)) == 0:
                out.append(Plan(dp=world // (tp * cp), tp=tp, cp=cp,
                                micro_batch=work.global_batch // (world // (tp * cp))))
    # ZeRO 1-3 over all ranks: their per-step costs are measured (calibrate_dist.zero_probe),
    # not summed (gpt-tiny's ZeRO-1 stepped in 19 ms against 9-11 ms from the arithmetic)
    if world == 2 and work.global_batch % world == 0:
        out += [Plan(dp=world, zero=z, micro_batch=work.global_batch // world) for z in (1, 2, 3)]
    return out


def measure(shape: ModelShape, work: Workload, cluster: Cluster, link: str = "loopback",
            plans=None, link_model: dict | None = None) -> Cluster:
    """This machine's numbers for these plans (default: dp/tp/cp over 2 ranks, one micro-batch):
    compute at each plan's local shape, the link (plain loopback, or a namespace shaped to
    `link` by probe_link; link_model: one already measured), codec seconds of the plans'
    compressors. The result's calibration holds them for both intra and inter links (2 ranks
    on one machine)."""
    plans = list(plans) if plans else default_plans(shape, work)
    if link_model is None:
        specs = [p.compress for p in plans]
        link_model = measure_loopback_link(specs=specs) if link == "loopback" else \
            probe_link(link, specs=specs)
    cal = dict(cluster.calibration)
    cal.update(measure_compute(shape, work, plans))
    cal["compute"].update(measure_cp_blocks(shape, work, plans))
    cal["compute"].update(measure_tp_blocks(shape, work, plans))
    cal["zero"] = {**cal.get("zero", {}), **measure_zero(shape, work, plans)}
    cal["pp"] = {**cal.get("pp", {}), **measure_pp(plans)}
    specs = {p.compress for p in plans} | {p.param_compress for p in plans}
    cal["codec"] = {**cal.get("codec", {}), **measure_codecs(specs, shape)}
    cal["link_intra"] = cal["link_inter"] = link_model
    # the communication's CPU work (gloo's copies through the kernel, the codec): on this
    # machine's cores it competes with compute (cluster.gpu "cpu": 2 ranks x 2 threads)
    cal["link_cpu"] = link_model if link == "loopback" else measure_loopback_link()
    cal["cpu_contention"] = 1.0 if cluster.gpu.name == "cpu" else 0.0
    cal["link"] = link
    mb = max(p.micro_batch for p in plans if p.cp == 1 and p.tp == 1) if any(
        p.cp == 1 and p.tp == 1 for p in plans) else plans[0].micro_batch
    cal["step_overhead_s"] = measure_job(shape, work, cluster.replace(calibration=cal), mb)
    return cluster.replace(calibration=cal)
