"""What :func:`lockstep.get_all_reported_checkpoints` returns: :class:`ReportedCheckpoint`, with
the enums Ray Train scripts pass or compare against (Ray Train 2.60's
``ray.train.v2.api.reported_checkpoint`` and ``report_config``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from lockstep.checkpoint import Checkpoint

__all__ = ["CheckpointConsistencyMode", "ReportedCheckpoint", "ReportedCheckpointStatus"]


class CheckpointConsistencyMode(enum.Enum):
    """What :func:`get_all_reported_checkpoints` waits for (as in Ray Train).

    COMMITTED: the checkpoints of every ``report()`` this rank has made are committed (an
    ASYNC upload still running is waited for). VALIDATED: the same here, since lockstep has no
    checkpoint validation step.
    """

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


class ReportedCheckpointStatus(enum.Enum):
    """The state of a :class:`ReportedCheckpoint`. lockstep has no validation step, so its
    checkpoints are always COMMITTED; the other members exist for scripts written for Ray Train."""

    COMMITTED = "COMMITTED"
    PENDING_VALIDATION = "PENDING_VALIDATION"
    VALIDATED = "VALIDATED"
    VALIDATION_TIMEOUT = "VALIDATION_TIMEOUT"
    VALIDATION_FAILED = "VALIDATION_FAILED"


@dataclass
class ReportedCheckpoint:
    """A committed checkpoint of the run and the metrics rank 0 reported with it.

    Attributes:
        checkpoint: The checkpoint in storage (or where NO_UPLOAD / ``checkpoint_upload_fn`` put it).
        metrics: The metrics of the ``report()`` that saved it.
        status: Always ``ReportedCheckpointStatus.COMMITTED`` (no validation step).
    """

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus = ReportedCheckpointStatus.COMMITTED
