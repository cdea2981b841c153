"""The report barrier: ``report()`` is a collective, so the controller collects each index's
calls until every rank has made it, then releases them all.

It also catches the two ways a barrier is never reached: a rank that returned from the train
function while others wait (:attr:`FailureKind.REPORT_MISMATCH`), and a rank that takes longer
than ``FailureConfig.report_timeout_s`` to arrive (:attr:`FailureKind.REPORT_TIMEOUT`).
"""

from __future__ import annotations

import time
from collections.abc import Collection

from lockstep._internal.run.failures import FailureKind
from lockstep._internal.wire.protocol import Report
from lockstep.errors import WorkerFailure


class ReportBarrier:
    """The ``report()`` calls of one worker group, by report index, until each is complete.

    Args:
        world_size: The number of ranks every report waits for.
        timeout_s: How long ranks may wait in a report for the others; ``None``: for ever.
    """

    def __init__(self, world_size: int, timeout_s: float | None = None) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.waiting: dict[int, dict[int, Report]] = {}
        self.waiting_since: dict[int, float] = {}
        self.reports_made: dict[int, int] = {}

    def arrive(self, report: Report) -> dict[int, Report] | None:
        """Add one rank's call; when it is the last of its index, return every rank's call by
        rank (and forget the index), else ``None``."""
        self.reports_made[report.rank] = report.index + 1
        calls = self.waiting.setdefault(report.index, {})
        self.waiting_since.setdefault(report.index, time.monotonic())
        calls[report.rank] = report
        if len(calls) < self.world_size:
            return None
        del self.waiting[report.index], self.waiting_since[report.index]
        return calls

    def left_behind(self, finished: Collection[int]) -> list[WorkerFailure]:
        """Failures for the ``finished`` ranks that will never make a report others wait in."""
        if not finished:
            return []
        for index, calls in self.waiting.items():
            gone = sorted(rank for rank in finished if rank not in calls)
            if gone:
                return [self._mismatch(rank, index, calls) for rank in gone]
        return []

    def _mismatch(self, rank: int, index: int, calls: dict[int, Report]) -> WorkerFailure:
        return FailureKind.REPORT_MISMATCH.failure(
            rank,
            f"returned from the train function after {self.reports_made.get(rank, 0)} report() calls while "
            f"rank(s) {_ranks(calls)} wait in report #{index}; every rank must call report() the same number "
            "of times.",
        )

    def time_to_deadline(self) -> float | None:
        """Seconds until the oldest waiting report is overdue; ``None`` when nothing can be."""
        if self.timeout_s is None or not self.waiting_since:
            return None
        return max(0.0, min(self.waiting_since.values()) + self.timeout_s - time.monotonic())

    def overdue(self) -> list[WorkerFailure]:
        """Failures for the ranks missing from the first report whose waiters waited too long."""
        if self.timeout_s is None:
            return []
        for index, since in self.waiting_since.items():
            if time.monotonic() - since >= self.timeout_s:
                calls = self.waiting[index]
                return [self._timeout(rank, index, calls) for rank in range(self.world_size) if rank not in calls]
        return []

    def _timeout(self, rank: int, index: int, calls: dict[int, Report]) -> WorkerFailure:
        return FailureKind.REPORT_TIMEOUT.failure(
            rank,
            f"did not call report #{index} within {self.timeout_s:g} s while rank(s) {_ranks(calls)} waited in it "
            "(FailureConfig.report_timeout_s).",
        )


def _ranks(calls: dict[int, Report]) -> str:
    return ", ".join(str(rank) for rank in sorted(calls))
