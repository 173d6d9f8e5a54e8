"""The old name of pyfast.ops.linear. pyfast/parallel/async_tp.py still imports
autocast_linear_args from here; once it imports from pyfast.ops.linear, delete this file."""
from pyfast.ops.linear import autocast_linear_args  # noqa: F401
