"""Tensor-parallel plans' module-name patterns, shared by parallelize (which applies a plan) and
the models (which resolve their plans to their own module names): below both."""
from __future__ import annotations

from fnmatch import fnmatchcase


def matches(pattern: str, name: str) -> bool:
    """Whether dotted module name `name` matches `pattern` atom by atom with fnmatch (as torch's
    parallelize_module does): "layers.*.fc1" matches "layers.3.fc1", not "layers.3.mlp.fc1"."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatchcase(a, b) for a, b in zip(n, p))
