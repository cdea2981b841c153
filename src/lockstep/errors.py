"""Errors raised by lockstep. All of them survive pickling, so they cross process boundaries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerFailure:
    """What went wrong on one rank.

    Attributes:
        rank: The world rank that failed.
        error_type: The exception's class name, e.g. ``"ValueError"``, or what lockstep saw:
            ``"WorkerDied"`` (the process ended without a Python error), ``"ReportMismatch"``
            (the rank returned while others waited in ``report()``), ``"CheckpointUploadError"``.
        message: The exception's message, or how the process ended.
        traceback: The worker's formatted traceback (empty when the process died without one).
    """

    rank: int
    error_type: str
    message: str
    traceback: str = ""

    def describe(self) -> str:
        """One paragraph for humans: the rank, the error and its traceback."""
        head = f"rank {self.rank}: {self.error_type}: {self.message}"
        return f"{head}\n{self.traceback.rstrip()}" if self.traceback else head


class TrainingFailedError(RuntimeError):
    """Training did not finish: a worker raised, died, or the run could not go on.

    Attributes:
        failures: The failures that ended the run, by rank.
    """

    def __init__(self, message: str, failures: dict[int, WorkerFailure] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, WorkerFailure] = dict(failures or {})

    def __reduce__(self) -> tuple[type, tuple[str, dict[int, WorkerFailure]]]:
        return (type(self), (self.args[0], self.failures))

    @classmethod
    def from_failures(
        cls, failures: list[WorkerFailure], context: str = "", stacks: dict[int, str] | None = None
    ) -> "TrainingFailedError":
        """Build the error shown to the user from the failures of one attempt, with the Python
        stacks of the ranks that were still running (where they were stuck)."""
        ranks = ", ".join(str(failure.rank) for failure in failures)
        lines = [f"Training failed on rank {ranks}{context}."]
        lines += [failure.describe() for failure in failures]
        lines += [f"rank {rank} was still running, here:\n{stack.rstrip()}" for rank, stack in sorted((stacks or {}).items())]
        return cls("\n\n".join(lines), {failure.rank: failure for failure in failures})


class SessionNotActiveError(RuntimeError):
    """A worker-only function (``report``, ``get_context``, …) was called outside a train function."""
