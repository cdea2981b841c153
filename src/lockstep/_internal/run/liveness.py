"""Which workers are alive, and what the controller does when they are not: :class:`Liveness`
follows one worker group's ranks until the attempt has an outcome; :class:`RestartPolicy`
decides, over the whole run, whether a failed attempt is retried (``max_failures``)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from lockstep._internal.run.failures import AttemptOutcome, FailureKind
from lockstep._internal.run.worker_group import WorkerExited
from lockstep.errors import TrainingFailedError, WorkerFailure, WorkerGroupError


class Liveness:
    """The ranks of one worker group: connected, finished, exited, failed.

    Args:
        world_size: The number of ranks in the group.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.started_at = time.monotonic()
        self.connected: set[int] = set()
        self.finished: set[int] = set()
        self.exited: set[int] = set()
        self.failures: list[WorkerFailure] = []
        self.grow = False

    @property
    def alive(self) -> int:
        """The number of ranks connected and not yet exited."""
        return len(self.connected - self.exited)

    @property
    def outcome(self) -> AttemptOutcome | None:
        """How the attempt ended, or ``None`` while it goes on (a failure wins over the rest)."""
        if self.failures:
            return AttemptOutcome.FAILED
        if len(self.exited) == self.world_size and len(self.finished) == self.world_size:
            return AttemptOutcome.SUCCEEDED
        return AttemptOutcome.GROW if self.grow else None

    def hello(self, rank: int) -> None:
        """``rank`` connected to the driver."""
        self.connected.add(rank)

    def finish(self, rank: int) -> None:
        """``rank``'s train function returned."""
        self.finished.add(rank)

    def fail(self, failures: list[WorkerFailure]) -> None:
        """Ranks failed (as they said, or as the driver found)."""
        self.failures += failures

    def exit(self, exited: WorkerExited, output_tail: Callable[[int], str]) -> None:
        """A process ended; without a Finished or Failed message first, that is a failure, shown
        with ``output_tail(rank)``: the last lines it wrote."""
        self.exited.add(exited.rank)
        if exited.rank in self.finished or exited.rank in {failure.rank for failure in self.failures}:
            return
        cause = exited.cause or f"the worker process {describe_exit(exited.returncode)}"
        self.failures.append(FailureKind.WORKER_DIED.failure(exited.rank, cause, output_tail(exited.rank)))

    def grow_if(self, can_grow: Callable[[int], bool]) -> None:
        """After a commit: end the attempt to restart larger when ``can_grow(world_size)``."""
        self.grow = self.grow or can_grow(self.world_size)

    def still_running(self) -> list[int]:
        """Ranks whose process is still there and that did not fail on their own (a rank that
        timed out in a report, or hung, is stuck, so still running)."""
        stuck = (FailureKind.REPORT_TIMEOUT, FailureKind.HANG)
        failed = {failure.rank for failure in self.failures if failure.error_type not in stuck}
        return [rank for rank in range(self.world_size) if rank not in self.exited and rank not in failed]


class RestartPolicy:
    """Counts failed attempts and says whether the run may start its workers again.

    Args:
        max_failures: Failed attempts allowed before the run fails; ``-1``: any number.
    """

    def __init__(self, max_failures: int) -> None:
        self.max_failures = max_failures
        self.history: list[TrainingFailedError] = []

    def record(self, error: TrainingFailedError) -> bool:
        """Count one failed attempt; return whether the workers may restart."""
        self.history.append(error)
        return self.may_restart

    @property
    def may_restart(self) -> bool:
        """Whether the failures so far are within ``max_failures``."""
        return self.max_failures < 0 or len(self.history) <= self.max_failures

    def final_error(self, error: TrainingFailedError) -> TrainingFailedError:
        """The error that ends the run: ``error``, or, when there were several, a
        :class:`WorkerGroupError` with every failure so far (``failures``: the last attempt's)."""
        if len(self.history) == 1:
            return error
        lines = [f"Training failed {len(self.history)} times (max_failures={self.max_failures})."]
        lines += [f"Failure {number}: {failure}" for number, failure in enumerate(self.history, 1)]
        kind = type(error) if isinstance(error, WorkerGroupError) else WorkerGroupError  # NCCLHangError stays one
        return kind("\n\n".join(lines), error.failures)


def describe_exit(returncode: int) -> str:
    """How a process ended, in words (with the usual cause of a SIGKILL)."""
    if returncode >= 0:
        return f"exited with code {returncode} before its train function returned"
    name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
    hint = " (often the out-of-memory killer)" if -returncode == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"
