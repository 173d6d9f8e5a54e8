"""Collectives that take a compressor."""
from pyfast.comm.collectives import NonFiniteGradient, all_reduce, choose

__all__ = ["all_reduce", "choose", "NonFiniteGradient"]
