"""Result: what a run produced — its metrics history, checkpoints, return value or error."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from lockstep._internal.metric_names import metric_value
from lockstep._internal.persist.results import result_fields
from lockstep._internal.persist.storage import RunStorage
from lockstep.checkpoint import Checkpoint

if TYPE_CHECKING:
    import pandas

__all__ = ["Result"]


@dataclass
class Result:
    """The outcome of ``fit()``, or of a run read back with :meth:`Result.from_path`.

    Attributes:
        metrics: Rank 0's metrics from the last ``report()`` (None before the first report),
            with its checkpoint's validation metrics when that checkpoint was validated.
        checkpoint: The latest committed checkpoint, or None.
        error: The error that ended the run, or None.
        path: The run folder (a URI for remote storage).
        filesystem: The fsspec filesystem holding ``path``.
        best_checkpoints: ``[(Checkpoint, metrics)]`` for the ``num_to_keep`` best checkpoints
            by ``CheckpointConfig.checkpoint_score_attribute``, worst first and best last, as Ray
            Train lists them; without a score attribute, the latest ones, oldest first; every
            checkpoint when ``num_to_keep`` is None. The latest checkpoint (``checkpoint``) is
            always kept in storage, but listed here only when it is among the best. A validated
            checkpoint's metrics include its validation's; one whose validation is still pending
            (an interrupted run) is not listed.
        return_value: What rank 0's train function returned (only from ``fit()``).
        num_failures: How many times the workers failed and were restarted (FailureConfig).
        metrics_history: Every report as a dict: ``report_index``, ``timestamp``,
            ``checkpoint_dir_name`` and the metrics.
    """

    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    error: BaseException | None
    path: str
    filesystem: Any = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    return_value: Any = None
    num_failures: int = 0
    metrics_history: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def metrics_dataframe(self) -> pandas.DataFrame | None:
        """One row per report: the metrics plus ``report_index``, ``timestamp`` and
        ``checkpoint_dir_name``; None when nothing was reported."""
        if not self.metrics_history:
            return None
        import pandas

        return pandas.DataFrame(self.metrics_history)

    def get_best_checkpoint(self, metric: str, mode: Literal["max", "min"]) -> Checkpoint | None:
        """The kept checkpoint whose reported ``metric`` is highest (``"max"``) or lowest (``"min"``);
        a nested metric is named by its path (``"val/acc"``).

        Raises:
            ValueError: ``mode`` is not max/min, or no kept checkpoint reported ``metric``.
        """
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}.")
        values = [(metric_value(metrics, metric), ckpt) for ckpt, metrics in self.best_checkpoints]
        scored = [(value, ckpt) for value, ckpt in values if value is not None]
        if not scored:
            if not self.best_checkpoints:
                return None
            raise ValueError(f"No checkpoint of this run reported the metric {metric!r}.")
        pick = max if mode == "max" else min
        return pick(scored, key=lambda pair: pair[0])[1]

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], storage_filesystem: Any = None) -> Result:
        """Read a finished, failed or interrupted run back from its folder (local path or URI).

        Raises:
            FileNotFoundError: the folder holds no lockstep run record.
        """
        run = RunStorage(path, storage_filesystem)
        record = run.read_record()
        if record is None:
            raise FileNotFoundError(
                f"{run.display_path!r} holds no lockstep run (no lockstep_run.json): pass the run "
                "folder, i.e. <storage_path>/<name>."
            )
        return cls(**result_fields(run, record, run.read_reports()))
