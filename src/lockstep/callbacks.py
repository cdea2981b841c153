"""Callbacks: code of yours that the driver runs as the run goes on, and loggers built on them.

Pass them in ``RunConfig(callbacks=[...])``. Each hook runs in the driver (the process that
called ``fit()``), after lockstep has recorded what it reports, so a slow callback delays the
next ``report()`` of every worker but never loses anything. A callback that raises is logged
with its traceback and switched off for the rest of the run; the training goes on. A hook can
stop the run with ``run.request_stop(reason)`` (see :class:`EarlyStopping`).

Ray Train 2.60's :class:`UserCallback` (hooks ``after_report(run_context, metrics, checkpoint)``
and ``after_exception(run_context, worker_exceptions)``) is accepted in the same list.

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

import difflib
import logging
import numbers
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from lockstep._internal.output.callback_base import (
    STOP_STATUSES,
    AttemptReason,
    AttemptStart,
    Callback,
    RunInfo,
    StopRequest,
    StopStatus,
    numeric_metrics,
)
from lockstep._internal.output.loggers import CSVLogger, JSONLogger, MLflowLogger, TensorBoardLogger
from lockstep.checkpoint import Checkpoint

__all__ = [
    "STOP_STATUSES",
    "AttemptReason",
    "AttemptStart",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "JSONLogger",
    "MLflowLogger",
    "RunInfo",
    "StopRequest",
    "StopStatus",
    "TensorBoardLogger",
    "TrainRunContext",
    "UserCallback",
    "check_callbacks",
    "misspelled_hooks",
    "numeric_metrics",
]

logger = logging.getLogger(__name__)


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

    def __init__(
        self, metric: str, mode: Literal["min", "max"] = "min", patience: int = 3, min_delta: float = 0.0
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}): use 'min' (lower is better) or 'max'.")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping(patience={patience!r}): use a whole number of reports, 1 or more.")
        if not isinstance(min_delta, numbers.Real) or min_delta < 0:
            raise ValueError(f"EarlyStopping(min_delta={min_delta!r}): use a number >= 0.")
        self.metric: str = metric
        self.mode: Literal["min", "max"] = mode
        self.patience: int = patience
        self.min_delta: float = float(min_delta)
        self.best: float | None = None
        self.best_index: int | None = None
        self.waited: int = 0

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
            run.request_stop(
                f"EarlyStopping: {self.metric} did not improve for {self.patience} reports "
                f"(best {self.best:.6g} at report #{self.best_index})"
            )

    def _improves(self, value: float) -> bool:
        assert self.best is not None
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


# -- Ray Train's callback interface ---------------------------------------------------------------


@dataclass
class TrainRunContext:
    """The run a :class:`UserCallback` is called for (Ray Train 2.60's ``TrainRunContext``).

    Attributes:
        run_config: The trainer's :class:`~lockstep.RunConfig`.
        train_loop_config: The config dict passed to the train function.
        scaling_config: The trainer's :class:`~lockstep.ScalingConfig`.
        backend_config: The trainer's backend config (``TorchConfig`` for ``TorchTrainer``).
        dataset_config: The trainer's :class:`~lockstep.DataConfig`.
        run_id: A new id for each ``fit()``.
    """

    # typed Any: lockstep.config imports this module (RunConfig checks its callbacks)
    run_config: Any
    train_loop_config: dict[str, Any] | None
    scaling_config: Any
    backend_config: Any
    dataset_config: Any
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def get_run_config(self) -> Any:
        """The run's RunConfig."""
        return self.run_config


class UserCallback:
    """Ray Train 2.60's callback interface, called in the driver: pass instances in
    ``RunConfig(callbacks=[...])`` as in Ray Train. (lockstep's own :class:`Callback` has more
    hooks; both kinds can be mixed in the list.) A hook that raises is logged with its traceback
    and that callback is switched off for the rest of the run; the training goes on.
    """

    def after_report(
        self, run_context: TrainRunContext, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None
    ) -> None:
        """Every rank made a ``report()``: ``metrics[i]`` is what rank ``i`` reported, and
        ``checkpoint`` the report's checkpoint, committed to storage (None without one). Called
        once per report, in report order; a report with an ASYNC checkpoint once it is committed."""

    def after_exception(self, run_context: TrainRunContext, worker_exceptions: dict[int, Exception]) -> None:
        """A worker group failed: ``worker_exceptions`` maps each failed rank to its error (a
        :class:`lockstep.WorkerError`, or the built-in exception class it names)."""


# -- checking them --------------------------------------------------------------------------------


def check_callbacks(callbacks: list[Any]) -> None:
    """Refuse anything that is not a lockstep Callback or UserCallback (e.g. a Ray Tune
    callback), and warn of a method that looks like a misspelled hook (it would never be called).

    Raises:
        ValueError: naming the offending entry.
    """
    for position, callback in enumerate(callbacks):
        if isinstance(callback, UserCallback):
            continue
        if not isinstance(callback, Callback):
            raise ValueError(
                f"RunConfig.callbacks[{position}] is a {type(callback).__module__}.{type(callback).__name__}, not a "
                "lockstep.callbacks.Callback. Use lockstep's loggers (CSVLogger, JSONLogger, TensorBoardLogger, "
                "MLflowLogger) or subclass lockstep.callbacks.Callback (or lockstep.UserCallback, Ray Train's "
                "interface)."
            )
        for name, hook in misspelled_hooks(type(callback)).items():
            logger.warning(
                "%s.%s is not a Callback hook, so it is never called: did you mean %s?",
                type(callback).__name__,
                name,
                hook,
            )


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
