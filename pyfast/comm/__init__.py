"""Collectives that take a compressor.

Every public `group` argument here, in pyfast.parallel and in pyfast.hooks (`process_group`
there, as torch's hooks name it) means the same: a torch.distributed process group, and None
means the default group (dist.group.WORLD), never "no group"."""
from pyfast.comm.collectives import NonFiniteGradient, all_reduce, choose
from pyfast.comm.failure import CommError
from pyfast.comm.sharded import all_gather, reduce_scatter

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "choose", "NonFiniteGradient", "CommError"]
