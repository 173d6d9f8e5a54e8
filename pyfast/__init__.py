"""pyfast: fast kernels, compressed collectives and drop-in parallel modules for PyTorch."""
__version__ = "0.1.0"
