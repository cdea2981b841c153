"""The types a train function's session is made of: :class:`TrainContext` (who this rank is)
and :class:`CheckpointUploadMode`. Public as ``lockstep.TrainContext`` and
``lockstep.CheckpointUploadMode`` (and from ``lockstep.context``); kept here, below the worker
session that builds them, so that nothing imports back into ``lockstep.context``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.persist.storage import RunStorage

__all__ = ["CheckpointUploadMode", "TrainContext"]


class CheckpointUploadMode(enum.Enum):
    """How ``report()`` persists a checkpoint.

    SYNC: the files are in storage when ``report()`` returns. ASYNC: ``report()`` returns once
    they are staged locally; they are uploaded in the background, in order, and the checkpoint
    counts (``Result.checkpoint``, ``get_checkpoint()``) once every rank's upload is done.
    NO_UPLOAD: the checkpoint is already where it should stay; it is registered at its path.
    """

    SYNC = "SYNC"
    ASYNC = "ASYNC"
    NO_UPLOAD = "NO_UPLOAD"


@dataclass(frozen=True)
class TrainContext:
    """Who this rank is in the run. Get it with :func:`lockstep.get_context` in a train function."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    storage: RunStorage
    metadata: dict[str, Any] = field(default_factory=dict)
    gpu_ids: tuple[str, ...] = ()

    def get_world_rank(self) -> int:
        """This worker's rank among all workers (0 … world_size-1)."""
        return self.world_rank

    def get_world_size(self) -> int:
        """How many workers the run has."""
        return self.world_size

    def get_local_rank(self) -> int:
        """This worker's rank among the workers on its node."""
        return self.local_rank

    def get_local_world_size(self) -> int:
        """How many workers run on this worker's node."""
        return self.local_world_size

    def get_node_rank(self) -> int:
        """The index of this worker's node."""
        return self.node_rank

    def get_experiment_name(self) -> str:
        """The run's name (``RunConfig.name``)."""
        return self.experiment_name

    def get_trial_name(self) -> str:
        """The run's name (kept for Ray Train compatibility)."""
        return self.experiment_name

    def get_storage(self) -> RunStorage:
        """The run folder: ``.run_path``, ``.filesystem``, ``.display_path``."""
        return self.storage

    def get_metadata(self) -> dict[str, Any]:
        """The ``metadata`` dict given to the trainer."""
        return dict(self.metadata)
