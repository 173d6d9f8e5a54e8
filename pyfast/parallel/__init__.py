"""Drop-in parallel training modules: data (DataParallel, DataParallelNaive) and pipeline
(Pipeline, schedules, traces); tensor parallelism follows (issue 4)."""
from .data import DataParallel, DataParallelNaive
from .pipeline import Pipeline
from .trace import save_trace

__all__ = ["DataParallel", "DataParallelNaive", "Pipeline", "save_trace"]
