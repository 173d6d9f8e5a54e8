"""What the ranks exchanged, read on the host, in a dry run too.

A dry run (pyfast.train.dryrun) runs one rank's step on memoryless tensors (the meta device)
over torch's fake process group: collectives move nothing, so a tensor that a collective filled
has no value to read. Where the code reads what the ranks exchanged (sizes, agreement digests,
NaN/Inf flags, used-parameter counts), it then takes every rank to have sent what this rank did
(the SPMD symmetry every pyfast collective assumes), which the caller states as `dry`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def moved_nothing(t: torch.Tensor, group=None) -> bool:
    """True when `t`, filled by a collective over `group`, holds no values: a meta tensor, or
    any tensor of a group on torch's fake backend."""
    return t.is_meta or fake_group(group)


def fake_group(group=None) -> bool:
    """True when `group` runs on torch's fake backend (a dry run's): it moves nothing."""
    backend = str(dist.get_backend(group)) if dist.is_initialized() else ""
    return "fake" in backend.replace(":", ",").split(",")  # "fake", or "meta:fake" (a dry run's)


def read(t: torch.Tensor, dry, group=None):
    """t.tolist() (a Python scalar for a 0-d or 1-element read the caller asks for), or `dry`
    where the collective that filled t moved nothing."""
    return dry if moved_nothing(t, group) else t.tolist()
