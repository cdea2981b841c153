"""The legacy session API (``from ray.air import session``): ``session.report(...)``,
``session.get_world_size()``, … Each function works inside a train function only."""

from __future__ import annotations

from lockstep.context import get_checkpoint, get_context, get_dataset_shard, report

__all__ = [
    "get_checkpoint",
    "get_dataset_shard",
    "get_experiment_name",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_trial_name",
    "get_world_rank",
    "get_world_size",
    "report",
]


def get_world_size() -> int:
    """How many workers the run has."""
    return get_context().get_world_size()


def get_world_rank() -> int:
    """This worker's rank among all workers."""
    return get_context().get_world_rank()


def get_local_rank() -> int:
    """This worker's rank on its node."""
    return get_context().get_local_rank()


def get_local_world_size() -> int:
    """How many workers run on this worker's node."""
    return get_context().get_local_world_size()


def get_node_rank() -> int:
    """The index of this worker's node."""
    return get_context().get_node_rank()


def get_experiment_name() -> str:
    """The run's name."""
    return get_context().get_experiment_name()


def get_trial_name() -> str:
    """The run's name (Ray Tune's trial name has no separate meaning here)."""
    return get_context().get_trial_name()

