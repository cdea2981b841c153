"""The legacy session API (``from ray.air import session``): ``session.report(...)``,
``session.get_world_size()``, … Each function works inside a train function only.

The Ray Tune notions Ray Train deprecated (``get_trial_dir``, ``get_trial_id``,
``get_trial_resources``, ``get_run_id``) import, and raise when called, saying what to use.
"""

from __future__ import annotations

from typing import Any

from lockstep._internal.ray_compat.deprecated import removed_function
from lockstep.context import get_checkpoint, get_context, get_dataset_shard, report

__all__ = [
    "get_checkpoint",
    "get_dataset_shard",
    "get_experiment_name",
    "get_local_rank",
    "get_local_world_size",
    "get_metadata",
    "get_node_rank",
    "get_run_id",
    "get_trial_dir",
    "get_trial_id",
    "get_trial_name",
    "get_trial_resources",
    "get_world_rank",
    "get_world_size",
    "report",
]

get_trial_dir = removed_function(
    "session.get_trial_dir",
    "pass the folder you want in train_loop_config; the run's own folder is "
    "lockstep.get_context().get_storage().display_path.",
)
get_trial_id = removed_function("session.get_trial_id", "lockstep.get_context().get_experiment_name() names the run.")
get_run_id = removed_function("session.get_run_id", "lockstep.get_context().get_experiment_name() names the run.")
get_trial_resources = removed_function(
    "session.get_trial_resources",
    "pass what the train function needs from ScalingConfig.resources_per_worker in train_loop_config; "
    "lockstep.torch.get_device() gives this rank's device.",
)


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


def get_metadata() -> dict[str, Any]:
    """The ``metadata`` dict given to the trainer."""
    return get_context().get_metadata()


def get_trial_name() -> str:
    """The run's name (Ray Tune's trial name has no separate meaning here)."""
    return get_context().get_trial_name()
