"""Optuna with lockstep: each ``fit()`` is one Optuna trial, and a trial that looks bad is pruned
while it runs.

Example:
    >>> import optuna
    >>> from lockstep.optuna import PruningCallback
    >>> def objective(trial):
    ...     config = {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True)}
    ...     trainer = TorchTrainer(train_fn, train_loop_config=config,
    ...                            scaling_config=ScalingConfig(num_workers=2),
    ...                            run_config=RunConfig(name=f"trial_{trial.number}",
    ...                                                 callbacks=[PruningCallback(trial, "val_loss")]))
    ...     return trainer.fit().metrics["val_loss"]
    >>> study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
    >>> study.optimize(objective, n_trials=8, n_jobs=2)  # two fits at once, each its own workers

Several driver processes (on one machine or several) can work on one study through Optuna's RDB
storage: ``optuna.create_study(study_name=..., storage="sqlite:///study.db", load_if_exists=True)``.

Needs the ``optuna`` package: ``pip install 'lockstep[optuna]'``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from lockstep.callbacks import Callback, RunInfo, numeric_metrics

__all__ = ["PruningCallback"]


logger = logging.getLogger(__name__)


def _import_optuna() -> Any:
    """The real ``optuna`` package (this module's name is the same, so it is imported by its
    absolute name).

    Raises:
        ImportError: it is not installed; the message says how to install it.
    """
    try:
        return importlib.import_module("optuna")
    except ImportError as error:
        raise ImportError(
            "lockstep.optuna needs Optuna, which is not installed: pip install 'lockstep[optuna]' "
            "(or pip install optuna)."
        ) from error


class PruningCallback(Callback):
    """Reports ``metric`` to an Optuna trial after each report (step = report index) and, when
    the study's pruner says so (``trial.should_prune()``), stops the run at that report: the
    checkpoints reported so far are committed, the run is recorded as ``pruned`` and ``fit()``
    raises ``optuna.TrialPruned``, which tells Optuna the trial was pruned.

    Args:
        trial: The ``optuna.Trial`` this ``fit()`` runs.
        metric: The reported metric the study optimizes (reports without it are not told).

    Raises:
        ImportError: Optuna is not installed.
    """

    def __init__(self, trial: Any, metric: str) -> None:
        self._optuna = _import_optuna()
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"PruningCallback(metric={metric!r}): name the reported metric the study optimizes.")
        self.trial = trial
        self.metric = metric
        self._warned = False

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        value = numeric_metrics(metrics).get(self.metric)
        if value is None:
            self._warn_missing(metrics)
            return
        self.trial.report(value, step=index)
        if self.trial.should_prune():
            message = f"Optuna pruned trial {self.trial.number} at report #{index} ({self.metric}={value:.6g})"
            run.request_stop(message, status="pruned", error=self._optuna.TrialPruned(message))

    def _warn_missing(self, metrics: dict[str, Any]) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "PruningCallback: the report has no number %r (it has %s); the trial is told nothing of such reports.",
                self.metric,
                ", ".join(metrics) or "nothing",
            )
