"""pyfast: fast kernels, compressed collectives and drop-in parallel modules for PyTorch.

`import pyfast` loads no submodule (not even torch): `pyfast.compress`, `pyfast.comm`,
`pyfast.parallel`, `pyfast.hooks`, ... are imported on first touch (PEP 562), so the
`pyfast` command and `import pyfast` stay fast and pay only for what they use. Measured
(python -X importtime, AMD EPYC 2 cores, shared): `import pyfast` 1.5-2.1 ms against 1.8-2.7 s
for `import torch`, which it used to include.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# The public layers, bottom to top (DESIGN.md)
SUBMODULES = ("ops", "compress", "comm", "parallel", "hooks", "models", "data", "train")


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # also sets it as an attribute
    if name == "_C":  # `from pyfast import _C`: torch first, it loads the libc10 _C links to
        importlib.import_module("torch")
        return importlib.import_module(f"{__name__}._C")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SUBMODULES))
