"""`pyfast train --offload optimizer|params [--offload-prefetch N] [--offload-delay]`: the flags,
their checks, and what the job passes to zero(offload=...) (pyfast.parallel.zero.offload_step;
user guide docs/offload.md). Kept here so config.py and job.py grow by a line or two each;
no torch import at module level (config.py parses flags without torch).
"""
from __future__ import annotations

import argparse

MODES = ("none", "optimizer", "params")


def add_flags(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("offload to host memory (--zero 1|2|3)")
    g.add_argument("--offload", default=d.offload, choices=MODES,
                   help="optimizer: the fp32 master shards, their gradients and the optimizer "
                        "state in host memory, the step on the host (ZeRO-Offload); params "
                        "(--zero 3): the parameter shards too (none: off)")
    g.add_argument("--offload-prefetch", type=int, default=d.offload_prefetch, metavar="N",
                   help="--zero 3: units all-gathered ahead of the one computing (up to N + 1 "
                        "gathered at once); --offload params copies each host -> device N "
                        "units before its gather")
    g.add_argument("--offload-delay", action="store_true", default=d.offload_delay,
                   help="ZeRO-Offload's one-step delayed update: step N applies step N-1's "
                        "gradients on the host while step N+1 runs (parameters one step stale)")


def problem(cfg) -> str | None:
    """What is wrong with the --offload* flags (zero() would refuse it), told by flag; None if
    nothing. config.check raises it as a ConfigError (this module imports nothing of config)."""
    off = cfg.offload
    if off not in MODES:
        return f"--offload {off!r}: one of {', '.join(MODES)}"
    if off == "none":
        if cfg.offload_delay or cfg.offload_prefetch != 1:
            return ("--offload-delay / --offload-prefetch tune --offload: they need "
                    "--offload optimizer or params")
        return None
    if not cfg.zero:
        return f"--offload {off} moves ZeRO's shards to host memory: it needs --zero 1, 2 or 3"
    if off == "params" and cfg.zero != 3:
        return (f"--offload params keeps stage 3's parameter shards on the host; --zero "
                f"{cfg.zero} keeps whole parameters on the device (use --offload optimizer, or "
                "--zero 3)")
    if cfg.offload_prefetch < 1:
        return f"--offload-prefetch must be >= 1, got {cfg.offload_prefetch}"
    if cfg.offload_prefetch != 1 and cfg.zero != 3:
        return (f"--offload-prefetch {cfg.offload_prefetch}: how many units stage 3 gathers "
                f"ahead; --zero {cfg.zero} has no per-unit gather")
    if cfg.offload_delay and cfg.precision == "fp16":
        return ("--offload-delay with --precision fp16: the loss scaler decides a step's skip "
                "from gradients the delayed step applies a step later; use bf16 or fp32")
    if cfg.diloco:
        return ("--offload with --diloco: DiLoCo sets the parameters zero's optimizer steps, "
                "which offload keeps as separate host masters; not supported")
    return None


def optim_cls(cfg, device=None):
    """AdamW for the job's zero(): pyfast.optim.AdamW (the C++ host kernel) with --offload where
    it is built and zero accepts it (docs/offload.md), and on a CPU job's shards, as the job
    without zero (pyfast.optim.job_adamw: torch's CPU default is a per-tensor loop); else torch's."""
    import torch
    if cfg.offload == "none" and device is not None and device.type == "cpu":
        from pyfast.ops.adamw import kernel_built
        from pyfast.optim import AdamW
        return AdamW if kernel_built() else torch.optim.AdamW
    if cfg.offload != "none":
        from pyfast.parallel.zero import PER_ELEMENT
        try:
            from pyfast.optim import AdamW
        except ImportError:
            return torch.optim.AdamW
        if AdamW in PER_ELEMENT:
            return AdamW
    return torch.optim.AdamW


def zero_kwargs(cfg) -> dict:
    """zero(offload=, prefetch=, delay=) of the flags ({} without --offload)."""
    if cfg.offload == "none":
        return {}
    return {"offload": cfg.offload, "prefetch": cfg.offload_prefetch,
            "delay": cfg.offload_delay}


def describe(job) -> str | None:
    """The run's summary line: what is offloaded and the host bytes a rank holds."""
    cfg, model = job.cfg, job.zero
    host = getattr(model, "_host", None)
    if host is None:
        return None
    from pyfast.parallel.zero.offload_step import host_bytes
    n = host_bytes(model.layout, type(job.opt.inner), cfg.offload_delay)
    opt = type(job.opt.inner)
    return (f"offload {cfg.offload}: fp32 master shards, gradients and {opt.__module__}."
            f"{opt.__name__} state in host memory, {n / 2**30:.3f} GiB a rank"
            + (", delayed update" if cfg.offload_delay else "")
            + ("" if job.device.type == "cuda" else " (on CPU host and device are the same "
               "memory)"))
