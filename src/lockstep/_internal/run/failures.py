"""The kinds of failure lockstep itself detects on a rank (as opposed to an exception the train
function raised, which keeps its own type name), and how an ended attempt turned out."""

from __future__ import annotations

import enum

from lockstep.errors import WorkerFailure


class FailureKind(str, enum.Enum):
    """What lockstep saw go wrong on a rank; the value is what ``WorkerFailure.error_type`` holds."""

    WORKER_DIED = "WorkerDied"
    """The process ended without a Finished or Failed message."""
    REPORT_MISMATCH = "ReportMismatch"
    """The rank returned from the train function while others wait in a ``report()``."""
    REPORT_TIMEOUT = "ReportTimeout"
    """The rank did not reach a ``report()`` others wait in, within ``report_timeout_s``."""
    CHECKPOINT_UPLOAD_ERROR = "CheckpointUploadError"
    """The rank's ASYNC checkpoint upload failed."""
    CHANNEL_VIOLATION = "ChannelViolation"
    """The rank's channel carried a message the rank may not send (one claiming another rank,
    or one only the driver sends); the driver closed that channel."""
    HANG = "Hang"
    """The rank stopped making progress while the others waited (or every rank did), for
    longer than the hang threshold (see :mod:`lockstep._internal.run.hang_watch`)."""

    def __str__(self) -> str:
        return self.value

    def failure(self, rank: int, message: str, traceback: str = "") -> WorkerFailure:
        """A :class:`WorkerFailure` of this kind on ``rank`` (its ``error_type`` a plain string,
        so it pickles and compares like a user exception's type name)."""
        return WorkerFailure(rank, self.value, message, traceback)


class AttemptOutcome(enum.Enum):
    """How one attempt (one worker group) ended."""

    SUCCEEDED = "succeeded"
    """Every rank's train function returned and every process exited."""
    FAILED = "failed"
    """At least one rank failed."""
    GROW = "grow"
    """An elastic run found room for more workers after a checkpoint: restart larger."""
