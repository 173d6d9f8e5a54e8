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

# The oldest torch pyfast runs on: point-to-point calls and broadcasts name their peer by its
# rank in the group (isend/irecv/broadcast's group_src= / group_dst=: pytorch#140460 and
# #140843; P2POp's group_peer=, which batch_isend_irecv takes: #141054; all merged November
# 2024, first released in torch 2.6.0). Every other torch API pyfast
# uses is older (torch.distributed.tensor public in 2.5, torch.library.register_fake in 2.4).
TORCH_MIN = (2, 6)


def check_torch(version: str) -> None:
    """ImportError naming `version` (torch's __version__) when it is older than TORCH_MIN."""
    try:
        have = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:  # a version string we cannot read: let torch's own imports decide
        return
    if have < TORCH_MIN:
        need = ".".join(map(str, TORCH_MIN))
        raise ImportError(f"pyfast needs torch >= {need} (isend/irecv/broadcast with group_src= "
                          f"and group_dst=); this environment has torch {version}: "
                          f"pip install 'torch>={need}'")


def _installed_torch() -> str | None:
    """torch's version from torch/version.py, without importing torch (about 2 s)."""
    import importlib.util
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None  # no torch: `import torch` says so where it is needed
    import os
    import re
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", f.read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


_torch = _installed_torch()
if _torch is not None:  # at import, before any submodule imports torch (2.6 = TORCH_MIN)
    check_torch(_torch)
del _torch

class _SourceKernels:
    """pyfast.kernels is the repository's kernels/ (setup.py's package_dir). In a source tree
    run with PYTHONPATH=<its root> (a git worktree beside an editable install of another
    checkout) the install's mapping would load the other checkout's kernels/, and its
    formats.py with them: this finder, first on sys.meta_path, names this tree's. Nothing is
    imported until pyfast.kernels is."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "pyfast.kernels":
            return None
        import importlib.util
        import os
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(self.root, "__init__.py"),
            submodule_search_locations=[self.root])


def _install_source_kernels() -> None:
    import os
    import sys
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    kernels = os.path.join(top, "kernels")
    if os.path.isfile(os.path.join(top, "setup.py")) and \
            os.path.isfile(os.path.join(kernels, "formats.py")):
        sys.meta_path.insert(0, _SourceKernels(kernels))


_install_source_kernels()

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
