"""The package's own exception types, at the bottom of the layers (plain Python, importable by
every layer, from ops/ up): each is raised by the layer that detects the problem, and the layers
above catch it by type, never by its message."""


class NonFiniteGradient(ValueError):
    """NaN/Inf in a gradient where they cannot pass: raised where they are found (ops.topk's
    count, random-k's check) and by the collectives identically on every rank. The same class
    as pyfast.compress.NonFiniteGradient and pyfast.comm.NonFiniteGradient."""


class NonFiniteError(RuntimeError):
    """The training job's loss or gradient norm is NaN/Inf (identical decision on every rank):
    raised by pyfast.train.job and, for a replica's verdict at a meeting, pyfast.train.outer;
    the job's runner exits 3 on it."""


class ExportError(ValueError):
    """Bad input to `pyfast export` (pyfast.export, pyfast.export_peft); the message names the
    path, step or flag."""
