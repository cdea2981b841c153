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
    ASYNC upload still running is waited for). VALIDATED: that, and no checkpoint validation is
    pending (see :mod:`lockstep.validation`).
    """

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


class ReportedCheckpointStatus(enum.Enum):
    """The state of a :class:`ReportedCheckpoint` (as in Ray Train 2.60).

    COMMITTED: saved, no validation asked for. PENDING_VALIDATION: saved, its validation has not
    ended. VALIDATED: its validation returned metrics (merged into the checkpoint's).
    VALIDATION_TIMEOUT: its validation ran past ``timeout_s`` and was stopped.
    VALIDATION_FAILED: its validation raised (or did not return a dict).
    """

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
        metrics: The metrics of the ``report()`` that saved it, with its validation's once VALIDATED.
        status: Where it stands, see :class:`ReportedCheckpointStatus`.
    """

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus = ReportedCheckpointStatus.COMMITTED
