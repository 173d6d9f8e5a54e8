"""pyfast: fast kernels, compressed collectives and drop-in parallel modules for PyTorch."""
import torch  # noqa: F401  (loads libc10/libtorch before pyfast._C needs them)

__version__ = "0.1.0"
