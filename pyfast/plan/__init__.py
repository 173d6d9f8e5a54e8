"""`pyfast plan`: which strategy for a model on a cluster. Enumerates the `pyfast train`
configurations (dp x cp x tp x pp, ZeRO stage, compressor, micro-batching, schedule,
activation checkpointing; on several nodes a DiLoCo candidate, diloco.py), predicts each
one's memory per rank (memory.py) and step time (timing.py: timing_compute, timing_link,
timing_reduce, timing_zero), and ranks what fits; checked against the dry run and against
measured runs (calibrate.py: calibrate_compute, calibrate_link, calibrate_job, refit)
(`pyfast bench plan`, docs/plan.md)."""


def main(argv=None) -> int:
    """`pyfast plan ARGS` (pyfast.plan.cli)."""
    from .cli import main as plan
    return plan(argv)
