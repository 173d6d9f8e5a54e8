# Moved to pyfast/benchmarks/epilogue.py (`pyfast bench epilogue`). This alias keeps
# tests/test_atomic_io.py's `import epilogue` (bench/ on sys.path) working until it imports
# pyfast.benchmarks.epilogue; then delete this file.
import sys

from pyfast.benchmarks import epilogue as _moved

sys.modules[__name__] = _moved
