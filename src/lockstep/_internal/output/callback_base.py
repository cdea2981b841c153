"""The callback interface: the :class:`Callback` base class and what its hooks are given
(:class:`RunInfo`, :class:`AttemptStart`). Public through :mod:`lockstep.callbacks`."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Literal

from lockstep._internal.metric_names import flat_metrics
from lockstep.checkpoint import Checkpoint

#: How a run that was asked to stop is recorded: ``"stopped"``, or ``"pruned"`` (a search
#: library such as Optuna gave up on it).
StopStatus = Literal["stopped", "pruned"]
STOP_STATUSES: tuple[StopStatus, ...] = ("stopped", "pruned")


@dataclass(frozen=True)
class StopRequest:
    """A request to stop the run, made with :meth:`RunInfo.request_stop`.

    Attributes:
        reason: Why, in words (logged, and kept in the run record as ``stop_reason``).
        status: The run's final status.
        error: Raised by ``fit()`` once the run is recorded, instead of returning the Result.
    """

    reason: str
    status: StopStatus = "stopped"
    error: BaseException | None = None


@dataclass(frozen=True)
class RunInfo:
    """The run a callback is called for.

    Attributes:
        name: The run's name.
        path: The run folder (a path, or a URI for remote storage).
        world_size: Number of workers.
        log_dir: A local folder for the callback's files: the run folder's ``logs/`` on local
            storage; on remote storage a local folder that is uploaded to ``logs/`` at the end.
    """

    name: str
    path: str
    world_size: int
    log_dir: str
    _stop_requests: list[StopRequest] = field(default_factory=list, repr=False, compare=False)

    def request_stop(self, reason: str, *, status: StopStatus = "stopped", error: BaseException | None = None) -> None:
        """Ask the driver to stop the run at a report barrier: the one being recorded when
        called from ``after_report`` (or ``on_checkpoint`` of that report), else the next one.
        Every rank leaves its train function from that ``report()``, the checkpoints reported
        so far are committed and the run ends with ``status``; ``fit()`` returns the Result, or
        raises ``error`` when one is given. The first request wins.

        Raises:
            ValueError: ``status`` is not one of ``"stopped"``, ``"pruned"``.
        """
        if status not in STOP_STATUSES:
            raise ValueError(f"request_stop(status={status!r}): use one of {', '.join(STOP_STATUSES)}.")
        if not self._stop_requests:
            self._stop_requests.append(StopRequest(str(reason), status, error))

    @property
    def stop_request(self) -> StopRequest | None:
        """The first stop request made in this run, if any."""
        return self._stop_requests[0] if self._stop_requests else None


#: Why a worker group starts: the first of the run, after a failure, or to grow an elastic run.
AttemptReason = Literal["start", "restart", "grow"]


@dataclass(frozen=True)
class AttemptStart:
    """A worker group about to start.

    Attributes:
        number: 1 for the first group of this ``fit()``, then 2, 3, …
        world_size: The group's number of workers (an elastic run's can change).
        reason: ``"start"`` (the first group), ``"restart"`` (after a failure) or ``"grow"``
            (an elastic run found room for more workers after a checkpoint).
        checkpoint: What the workers resume from (``get_checkpoint()``), if anything.
        failures: Failed attempts so far in this ``fit()``.
        max_failures: Failed attempts allowed (``-1``: any number).
    """

    number: int
    world_size: int
    reason: AttemptReason
    checkpoint: Checkpoint | None
    failures: int
    max_failures: int


class Callback:
    """Base class of callbacks: override the hooks you need (each does nothing by default).

    The hooks, in the order a run calls them: ``on_run_start``; then for each worker group
    ``on_attempt_start``, ``on_workers_changed`` as workers connect and exit, ``after_report``
    and ``on_checkpoint`` as reports and checkpoints are committed, ``on_failure`` when the group
    fails; finally ``on_run_end``.
    """

    def on_run_start(self, run: RunInfo) -> None:
        """Before the first workers start (also when a run is continued)."""

    def on_attempt_start(self, run: RunInfo, attempt: AttemptStart) -> None:
        """A worker group is about to start: the first, or one after a failure or to grow."""

    def on_workers_changed(self, run: RunInfo, alive: int) -> None:
        """A worker connected or exited: ``alive`` workers of the group are running now."""

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        """Every rank made report ``index``; ``metrics`` are rank 0's, as recorded."""

    def on_checkpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
        """The checkpoint of report ``index`` is committed (in storage and in the run record)."""

    def on_failure(self, run: RunInfo, error: Exception, restarting: bool) -> None:
        """An attempt failed; ``restarting`` says whether the workers start again."""

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        """The run ended: ``status`` is ``"finished"``, ``"stopped"``, ``"pruned"``,
        ``"failed"``, ``"interrupted"`` or ``"preempted"``."""


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are numbers (bools left out), as floats; a nested one named by its path
    (``"val/loss"``, as Ray Tune names it)."""
    return {
        key: float(value)
        for key, value in flat_metrics(metrics).items()
        if isinstance(value, numbers.Real) and not isinstance(value, bool)
    }
