"""Collectives that take a compressor."""
from pyfast.comm.collectives import NonFiniteGradient, all_reduce, choose
from pyfast.comm.failure import CommError
from pyfast.comm.sharded import all_gather, reduce_scatter

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "choose", "NonFiniteGradient", "CommError"]
