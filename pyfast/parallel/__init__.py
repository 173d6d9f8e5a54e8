"""Drop-in parallel training modules: data (DataParallel, DataParallelNaive) and pipeline
(Pipeline, schedules, traces) and tensor (ColumnParallelLinear, RowParallelLinear)."""
from .data import DataParallel, DataParallelNaive
from .pipeline import Pipeline
from .tensor import ColumnParallelLinear, RowParallelLinear
from .trace import save_trace

__all__ = ["ColumnParallelLinear", "DataParallel", "DataParallelNaive", "Pipeline",
           "RowParallelLinear", "save_trace"]
