"""Stopping a run before its train function ends: ``RunConfig(stop=...)`` and callbacks that
call ``run.request_stop(...)`` (:class:`~lockstep.callbacks.EarlyStopping`, Optuna's pruning).

A stop is decided at a report barrier, so every rank leaves at the same step: the ranks learn it
from that report's ``ReportDone`` (``stop=True``, with no preemption notice), wait for their own
checkpoint uploads, and leave their train function from ``report()`` with the internal
:class:`~lockstep._internal.run.preemption.PreemptionStop`, as a preempted run's ranks do. The
controller commits the checkpoints reported so far, records the run as ``stopped`` (or
``pruned``), and ``fit()`` returns the Result (or raises the request's error).
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any

from lockstep._internal.metric_names import flat_metrics
from lockstep._internal.output.progress import log_clear_of_line
from lockstep.callbacks import Callback, RunInfo, StopRequest
from lockstep.errors import WorkerFailure
from lockstep.result import Result

logger = logging.getLogger(__name__)

#: How long ranks told to stop may take to leave their train function (once every checkpoint is
#: committed) before the driver stops their processes.
STOP_GRACE_S = 30.0

#: What ``RunConfig(stop=...)`` takes: metric -> threshold, or ``(report_index, metrics) -> bool``.
StopCriteria = Mapping[str, float] | Callable[[int, dict[str, Any]], bool]


class StopCondition(Callback):
    """``RunConfig(stop=...)`` as a built-in callback: after each report, request a stop when a
    threshold is reached or the function says so.

    As in Ray Tune, a threshold is reached when the reported value is ``>=`` it; a nested
    metric is named with slashes (``"val/loss"``), and ``training_iteration`` is the number of
    reports so far (report index + 1) unless the train function reports its own.
    """

    def __init__(self, criteria: StopCriteria) -> None:
        self.criteria = criteria
        self._missing_warned: set[str] = set()

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        values = {"training_iteration": index + 1, **flat_metrics(metrics)}
        if callable(self.criteria):
            if self.criteria(index, {"training_iteration": index + 1, **metrics}):
                run.request_stop(f"RunConfig(stop=...) returned True at report #{index}")
            return
        for key, threshold in self.criteria.items():
            value = values.get(key)
            if value is None:
                self._warn_missing(key, values)
            elif isinstance(value, numbers.Real) and float(value) >= threshold:
                run.request_stop(f"RunConfig(stop=...): {key}={value:g} reached {threshold:g} at report #{index}")
                return

    def _warn_missing(self, key: str, values: dict[str, Any]) -> None:
        if key not in self._missing_warned:
            self._missing_warned.add(key)
            log_clear_of_line(
                logger,
                logging.WARNING,
                "RunConfig(stop=...): %r is not among the reported metrics (%s); the run goes on until it is reported.",
                key,
                ", ".join(sorted(values)),
            )


class Stopping:
    """The controller's account of a stop request: at which report it was decided, and how long
    the ranks may take to leave.

    Args:
        run: The run whose callbacks may request a stop.
        grace_s: See :data:`STOP_GRACE_S`.
    """

    def __init__(self, run: RunInfo, grace_s: float = STOP_GRACE_S) -> None:
        self.run = run
        self.grace_s = grace_s
        self.at_index: int | None = None
        self.deadline: float | None = None

    @property
    def request(self) -> StopRequest | None:
        """The stop that was decided, if any."""
        return self.run.stop_request if self.at_index is not None else None

    def decide(self, index: int) -> bool:
        """At the barrier of report ``index``: whether the ranks are told to stop (a request was
        made, now or earlier)."""
        request = self.run.stop_request
        if request is None:
            return False
        if self.at_index is None:
            self.at_index, self.deadline = index, time.monotonic() + self.grace_s
            log_clear_of_line(
                logger, logging.INFO, "Stopping run %s after report #%d: %s.", self.run.name, index, request.reason
            )
        return True

    def left(self, failure: WorkerFailure) -> bool:
        """Whether a rank's failure is its leaving after being told to stop."""
        return self.at_index is not None and failure.error_type == "PreemptionStop"

    def time_left(self, commits_pending: bool) -> float | None:
        """Seconds the ranks have left to end on their own; None before a stop, or while
        checkpoints wait to be committed (the ranks upload them before they leave)."""
        if self.deadline is None or commits_pending:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def gives_up(self, commits_pending: bool) -> bool:
        """Whether the driver stops waiting for ranks to leave: the grace ran out after every
        checkpoint was committed."""
        return self.time_left(commits_pending) == 0.0

    def outcome(self, result: Result) -> Result:
        """``result``, or the stop request's error raised instead."""
        request = self.request
        if request is not None and request.error is not None:
            raise request.error
        return result
