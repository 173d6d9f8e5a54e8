"""Drop-in parallel training modules: data (DataParallel, DataParallelNaive), pipeline
(Pipeline, schedules, traces) and tensor (ColumnParallelLinear, RowParallelLinear,
parallelize)."""
from .data import DataParallel, DataParallelNaive
from .parallelize import parallelize
from .pipeline import Pipeline
from .tensor import ColumnParallelLinear, RowParallelLinear
from .trace import save_trace

__all__ = ["ColumnParallelLinear", "DataParallel", "DataParallelNaive", "Pipeline",
           "RowParallelLinear", "parallelize", "save_trace"]
