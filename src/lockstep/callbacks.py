"""Callbacks: code of yours that the driver runs as the run goes on, and loggers built on them.

Pass them in ``RunConfig(callbacks=[...])``. Each hook runs in the driver (the process that
called ``fit()``), after lockstep has recorded what it reports, so a slow callback delays the
next ``report()`` of every worker but never loses anything. A callback that raises is logged
with its traceback and switched off for the rest of the run; the training goes on. A hook can
stop the run with ``run.request_stop(reason)`` (see :class:`EarlyStopping`).

Example:
    >>> from lockstep.callbacks import Callback, CSVLogger
    >>> class PrintBest(Callback):
    ...     best = float("inf")
    ...     def after_report(self, run, index, metrics):
    ...         if metrics.get("loss", self.best) < self.best:
    ...             self.best = metrics["loss"]
    ...             print(f"report {index}: new best loss {self.best:.4f}")
    >>> run_config = RunConfig(callbacks=[PrintBest(), CSVLogger()])
"""

from __future__ import annotations

import csv
import difflib
import json
import logging
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from lockstep.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


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
    """The metrics that are numbers (bools left out), as floats."""
    return {
        key: float(value) for key, value in metrics.items()
        if isinstance(value, numbers.Real) and not isinstance(value, bool)
    }


# -- stopping -----------------------------------------------------------------------------------


class EarlyStopping(Callback):
    """Stops the run once ``metric`` has not improved for ``patience`` reports in a row.

    Args:
        metric: The reported metric to watch (reports without it are not counted).
        mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"`` (e.g. an accuracy).
        patience: How many reports in a row without improvement end the run.
        min_delta: How much better than the best so far a value must be to count as improved.

    Example:
        >>> RunConfig(callbacks=[EarlyStopping("val_loss", mode="min", patience=3)])
    """

    def __init__(self, metric: str, mode: Literal["min", "max"] = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}): use 'min' (lower is better) or 'max'.")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping(patience={patience!r}): use a whole number of reports, 1 or more.")
        if not isinstance(min_delta, numbers.Real) or min_delta < 0:
            raise ValueError(f"EarlyStopping(min_delta={min_delta!r}): use a number >= 0.")
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, float(min_delta)
        self.best: float | None = None
        self.best_index: int | None = None
        self.waited = 0

    def on_run_start(self, run: RunInfo) -> None:
        self.best, self.best_index, self.waited = None, None, 0

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        value = numeric_metrics(metrics).get(self.metric)
        if value is None:
            return
        if self.best is None or self._improves(value):
            self.best, self.best_index, self.waited = value, index, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            run.request_stop(f"EarlyStopping: {self.metric} did not improve for {self.patience} reports "
                             f"(best {self.best:.6g} at report #{self.best_index})")

    def _improves(self, value: float) -> bool:
        assert self.best is not None
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


# -- the loggers --------------------------------------------------------------------------------


class JSONLogger(Callback):
    """Appends each report as one JSON object (``report_index`` plus the metrics) to a file.

    Args:
        path: The file; default ``<log_dir>/metrics.jsonl``.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._file: Any = None

    def on_run_start(self, run: RunInfo) -> None:
        self.path = self.path or os.path.join(run.log_dir, "metrics.jsonl")
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in on_run_end

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps({"report_index": index, **metrics}, default=str) + "\n")
        self._file.flush()

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        if self._file is not None:
            self._file.close()


class CSVLogger(Callback):
    """Writes the reports as a CSV table, one row per report; a metric that first appears later
    adds a column (the file is then rewritten with the wider header).

    Args:
        path: The file; default ``<log_dir>/metrics.csv``. Rows already in it are kept.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []

    def on_run_start(self, run: RunInfo) -> None:
        self.path = self.path or os.path.join(run.log_dir, "metrics.csv")
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.exists(self.path):
            with open(self.path, newline="", encoding="utf-8") as handle:
                reader = csv.DictReader(handle)
                self._columns = list(reader.fieldnames or [])
                self._rows = list(reader)

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        row = {"report_index": index, **metrics}
        self._rows.append(row)
        new_columns = [key for key in row if key not in self._columns]
        if new_columns or not os.path.exists(str(self.path)):
            self._columns += new_columns
            self._write(self._rows, "w", header=True)
        else:
            self._write([row], "a", header=False)

    def _write(self, rows: list[dict[str, Any]], mode: str, header: bool) -> None:
        with open(str(self.path), mode, newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=self._columns, restval="")
            if header:
                writer.writeheader()
            writer.writerows(rows)


class TensorBoardLogger(Callback):
    """Writes every numeric metric as a TensorBoard scalar, at step = report index.

    Args:
        log_dir: The event-file folder; default ``<log_dir>/tensorboard``. Open it with
            ``tensorboard --logdir <folder>``.

    Raises:
        ImportError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, log_dir: str | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as error:
            raise ImportError("TensorBoardLogger needs the tensorboard package: pip install tensorboard") from error
        self.log_dir = log_dir
        self._writer: Any = None

    def on_run_start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = self.log_dir or os.path.join(run.log_dir, "tensorboard")
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        for key, value in numeric_metrics(metrics).items():
            self._writer.add_scalar(key, value, global_step=index)
        self._writer.flush()

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        if self._writer is not None:
            self._writer.close()


class MLflowLogger(Callback):
    """Logs the run to MLflow: one MLflow run per lockstep run, every numeric metric at step =
    report index, each committed checkpoint's path as a tag, and the end status.

    Args:
        tracking_uri: Where MLflow keeps runs, e.g. ``"file:///tmp/mlruns"`` or a server URL;
            default: MLflow's own (``MLFLOW_TRACKING_URI``, else ``./mlruns``).
        experiment_name: The MLflow experiment (created when missing); default ``"lockstep"``.
        tags: Extra tags for the MLflow run.

    Raises:
        ImportError: neither ``mlflow`` nor ``mlflow-skinny`` is installed.
    """

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "lockstep",
                 tags: dict[str, str] | None = None) -> None:
        try:
            from mlflow.tracking import MlflowClient  # noqa: F401
        except ImportError as error:
            raise ImportError("MLflowLogger needs MLflow: pip install mlflow-skinny (or mlflow)") from error
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._client: Any = None

    def on_run_start(self, run: RunInfo) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(self.experiment_name)
        tags = {"mlflow.runName": run.name, "lockstep.path": run.path, "lockstep.world_size": str(run.world_size), **self.tags}
        self.run_id = self._client.create_run(experiment_id, tags=tags).info.run_id

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        for key, value in numeric_metrics(metrics).items():
            self._client.log_metric(self.run_id, key, value, step=index)

    def on_checkpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
        self._client.set_tag(self.run_id, "lockstep.latest_checkpoint", checkpoint.path)

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        if self._client is not None and self.run_id is not None:
            statuses = {"finished": "FINISHED", "stopped": "FINISHED", "pruned": "KILLED", "interrupted": "KILLED"}
            self._client.set_terminated(self.run_id, statuses.get(status, "FAILED"))


# -- checking them --------------------------------------------------------------------------------


def check_callbacks(callbacks: list[Any]) -> None:
    """Refuse anything that is not a lockstep Callback (e.g. a Ray Tune callback), and warn of a
    method that looks like a misspelled hook (it would never be called).

    Raises:
        ValueError: naming the offending entry.
    """
    for position, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            raise ValueError(
                f"RunConfig.callbacks[{position}] is a {type(callback).__module__}.{type(callback).__name__}, not a "
                "lockstep.callbacks.Callback. Use lockstep's loggers (CSVLogger, JSONLogger, TensorBoardLogger, "
                "MLflowLogger) or subclass lockstep.callbacks.Callback."
            )
        for name, hook in misspelled_hooks(type(callback)).items():
            logger.warning("%s.%s is not a Callback hook, so it is never called: did you mean %s?",
                           type(callback).__name__, name, hook)


def misspelled_hooks(cls: type[Callback]) -> dict[str, str]:
    """The methods of ``cls`` named almost like a hook of :class:`Callback`, with that hook."""
    hooks = [name for name in vars(Callback) if name.startswith(("on_", "after_"))]
    found = {}
    for klass in cls.__mro__[:-1]:
        for name in vars(klass):
            close = difflib.get_close_matches(name, hooks, n=1, cutoff=0.85)
            if close and name not in hooks:
                found[name] = close[0]
    return found
