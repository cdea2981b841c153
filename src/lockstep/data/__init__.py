"""Datasets given to the trainer with ``datasets=``, split into one shard per rank."""

from lockstep.data.shards import DatasetShard, shard_datasets

__all__ = ["DatasetShard", "shard_datasets"]
