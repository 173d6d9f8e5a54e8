"""ZeRO-1/2/3 sharded data parallelism (issue 12). layout: the sharding contract."""
from .layout import Layout, ParamShard, Unit, bucket_groups, shard_range, shard_size

__all__ = ["Layout", "ParamShard", "Unit", "bucket_groups", "shard_range", "shard_size"]
