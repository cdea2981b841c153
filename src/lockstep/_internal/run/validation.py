"""The driver's side of checkpoint validation (``TorchTrainer(validation_config=...)``, see
:mod:`lockstep.validation`): which validations wait, which one runs, when one has run too long,
and what each outcome does to the run record.

As in Ray Train 2.60, a checkpoint reported with ``validation=...`` is validated once it is
committed, one validation at a time, in report order; the function gets the trainer's default
``fn_kwargs`` with those of the report's ``ValidationTaskConfig`` over them, and the report's
``timeout_s`` (or, for ``validation=True``, the default's). The outcome is recorded by
:meth:`RunRecorder.finish_validation`: VALIDATED with the returned metrics, VALIDATION_FAILED
(it raised, or returned no dict of metrics) or VALIDATION_TIMEOUT (stopped at its timeout).
Neither of the last two fails the run. Validations outlive attempts (a restart doesn't stop
them); :meth:`Validations.wait_all` runs those left before the run ends, and
:meth:`Validations.abort` stops them when the run is interrupted: they stay pending in the
record, and the next run of the same name starts them again (:class:`Validations` picks up the
record's pending ones when it is made).

Where a validation runs is the executor's business: it gives a :class:`ValidationLauncher`
(a fresh process on this machine, a Ray task on a cluster). The driver only ever receives the
metrics as JSON, never a pickle.
"""

from __future__ import annotations

import abc
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lockstep._internal.persist.storage import CheckpointEntry
from lockstep._internal.run.run_record import VALIDATED, RunRecorder
from lockstep.checkpoint import Checkpoint
from lockstep.validation import ValidationConfig

logger = logging.getLogger(__name__)

#: How often the driver looks at a running validation (it has no handle to wait on beside the
#: workers'; Ray Train looks once a second).
POLL_INTERVAL_S = 0.2
#: Validations that run at once (Ray Train 2.60's ``MAX_IN_FLIGHT_VALIDATIONS``).
MAX_IN_FLIGHT_VALIDATIONS = 1
VALIDATION_FAILED = "VALIDATION_FAILED"
VALIDATION_TIMEOUT = "VALIDATION_TIMEOUT"


@dataclass(frozen=True)
class ValidationTask:
    """One validation to run: the validation function on ``checkpoint`` with ``fn_kwargs``.

    Attributes:
        dir_name: The checkpoint's folder name (names the validation in logs and log files).
        checkpoint: The committed checkpoint.
        fn_kwargs: The keyword arguments, merged.
    """

    dir_name: str
    checkpoint: Checkpoint
    fn_kwargs: dict[str, Any]


@dataclass(frozen=True)
class ValidationOutcome:
    """How a validation ended: its ``metrics`` (a dict decoded from JSON), or the ``error`` that
    ended it, in words (a traceback)."""

    metrics: dict[str, Any] | None = None
    error: str | None = None


class RunningValidation(abc.ABC):
    """A validation the launcher started."""

    @abc.abstractmethod
    def wait(self, timeout: float | None) -> ValidationOutcome | None:
        """Wait up to ``timeout`` seconds (0: just look; None: until it ends) for the outcome;
        None while it runs."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop it now, with whatever it started (idempotent)."""


class ValidationLauncher(abc.ABC):
    """Starts validations where the run's executor runs them."""

    @abc.abstractmethod
    def start(self, task: ValidationTask) -> RunningValidation:
        """Start the validation function on ``task``'s checkpoint; return at once."""


@dataclass(frozen=True)
class ValidationSetup:
    """What a run with validation needs: the trainer's ``config`` and the executor's ``launcher``."""

    config: ValidationConfig
    launcher: ValidationLauncher


@dataclass
class _InFlight:
    entry: CheckpointEntry
    running: RunningValidation
    started: float
    timeout_s: float | None

    def time_left(self, now: float) -> float | None:
        return None if self.timeout_s is None else self.started + self.timeout_s - now


class Validations:
    """The run's validations: waiting ones in report order, and those in flight.

    Args:
        setup: The trainer's validation config and the executor's launcher.
        recorder: The run record (its pending validations are queued at once).
        max_in_flight: Validations that may run at once.
    """

    def __init__(self, setup: ValidationSetup, recorder: RunRecorder, max_in_flight: int = MAX_IN_FLIGHT_VALIDATIONS):
        self.config = setup.config
        self.launcher = setup.launcher
        self.recorder = recorder
        self.max_in_flight = max_in_flight
        self._waiting: deque[CheckpointEntry] = deque(recorder.pending_validations())
        self._in_flight: list[_InFlight] = []
        if self._waiting:
            logger.info(
                "%d checkpoint(s) of an earlier run of %s await validation: %s.",
                len(self._waiting),
                recorder.storage.name,
                ", ".join(entry.dir_name for entry in self._waiting),
            )

    @property
    def pending(self) -> bool:
        """Whether any validation waits or runs."""
        return bool(self._waiting or self._in_flight)

    def submit(self, entry: CheckpointEntry) -> None:
        """Queue the validation of a checkpoint just committed as pending validation; start it
        if a slot is free."""
        self._waiting.append(entry)
        self.poll()

    def poll(self) -> bool:
        """Record the validations that ended or ran out of time, start waiting ones in the free
        slots; return whether any ended."""
        now = time.monotonic()
        ended = False
        for flight in list(self._in_flight):
            left = flight.time_left(now)
            outcome = flight.running.wait(0)
            if outcome is None and left is not None and left <= 0:
                flight.running.cancel()
                self._end(flight, VALIDATION_TIMEOUT, {}, f"it ran past its timeout_s={flight.timeout_s:g}")
                ended = True
            elif outcome is not None:
                self._end_with(flight, outcome)
                ended = True
        self._start_waiting()
        return ended

    def time_left(self) -> float | None:
        """How long the driver may wait before it must :meth:`poll` again (None: no need)."""
        if not self._in_flight:
            return None
        now = time.monotonic()
        deadlines = [left for flight in self._in_flight if (left := flight.time_left(now)) is not None]
        return max(0.0, min([POLL_INTERVAL_S, *deadlines]))

    def wait_all(self, check: Callable[[], object] | None = None) -> None:
        """Run every waiting validation to its end (``fit()`` waits for them before it returns);
        ``check`` is called every :data:`POLL_INTERVAL_S` meanwhile, and stops the wait by raising."""
        if self.pending:
            logger.info("Waiting for %d checkpoint validation(s) to end.", len(self._waiting) + len(self._in_flight))
        while self.pending:
            if check is not None:
                check()
            self.poll()
            if self._in_flight:
                flight = self._in_flight[0]
                left = flight.time_left(time.monotonic())
                flight.running.wait(POLL_INTERVAL_S if left is None else max(0.0, min(left, POLL_INTERVAL_S)))

    def abort(self) -> None:
        """Stop the validations in flight; they stay pending in the record (the next run of the
        same name starts them again)."""
        for flight in self._in_flight:
            flight.running.cancel()
            logger.info(
                "The validation of %s was stopped; the next run of %s starts it again.",
                flight.entry.dir_name,
                self.recorder.storage.name,
            )
        self._in_flight.clear()
        self._waiting.clear()

    # -- starting and ending ----------------------------------------------------------------

    def _start_waiting(self) -> None:
        while self._waiting and len(self._in_flight) < self.max_in_flight:
            entry = self._waiting.popleft()
            fn_kwargs, timeout_s = self._resolved(entry.validation_request)
            task = ValidationTask(entry.dir_name, self.recorder.storage.checkpoint_of(entry), fn_kwargs)
            self._in_flight.append(_InFlight(entry, self.launcher.start(task), time.monotonic(), timeout_s))
            logger.info("Validating %s.", entry.dir_name)

    def _resolved(self, request: bool | dict[str, Any] | None) -> tuple[dict[str, Any], float | None]:
        """The keyword arguments and timeout of a request: the defaults for True; else the
        request's fn_kwargs over the defaults, and the request's timeout (None included)."""
        defaults = self.config.task_config
        if not isinstance(request, dict):
            return dict(defaults.fn_kwargs or {}), defaults.timeout_s
        return {**(defaults.fn_kwargs or {}), **request.get("fn_kwargs", {})}, request.get("timeout_s")

    def _end_with(self, flight: _InFlight, outcome: ValidationOutcome) -> None:
        if outcome.metrics is not None:
            self._end(flight, VALIDATED, outcome.metrics)
        else:
            self._end(flight, VALIDATION_FAILED, {}, outcome.error or "no reason given")

    def _end(self, flight: _InFlight, status: str, metrics: dict[str, Any], why: str | None = None) -> None:
        self._in_flight.remove(flight)
        name = flight.entry.dir_name
        if why is None:
            logger.info("Validated %s in %.1f s: %s", name, time.monotonic() - flight.started, metrics)
        else:
            logger.warning("The validation of %s ended as %s: %s", name, status, why)
        self.recorder.finish_validation(name, status, metrics)
