"""Drop-in parallel training modules: mesh (Mesh, the dp x cp x tp x pp groups), data
(DataParallel), context (context_parallel_attention: ring and Ulysses attention on
sequence shards), pipeline (Pipeline, schedules, traces) and tensor (ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy, parallelize),
diloco (DiLoCo: the outer loop over replicas, each replica any of the above)."""
from .context import context_parallel_attention, shard_sequence, unshard_sequence
from .data import DataParallel
from .diloco import DiLoCo
from .mesh import Mesh
from .parallelize import parallelize
from .pipeline import Pipeline, PipelineCommError, PipelineError
from .tensor import ColumnParallelLinear, RowParallelLinear
from .trace import save_trace
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from .zero import ZeroOptimizer, zero

__all__ = ["ColumnParallelLinear", "context_parallel_attention", "shard_sequence",
           "unshard_sequence", "DataParallel", "DiLoCo", "Mesh", "Pipeline",
           "PipelineCommError", "PipelineError",
           "RowParallelLinear", "VocabParallelEmbedding", "parallelize", "save_trace",
           "vocab_parallel_cross_entropy", "ZeroOptimizer", "zero"]
