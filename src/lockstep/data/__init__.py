"""Datasets given to the trainer with ``datasets=``, split into one shard per rank."""

from lockstep.data.ray_shards import RayDataShard, is_ray_data_iterator
from lockstep.data.shards import DatasetShard, shard_datasets

__all__ = ["DatasetShard", "RayDataShard", "is_ray_data_iterator", "shard_datasets"]
