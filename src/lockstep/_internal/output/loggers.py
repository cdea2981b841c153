"""lockstep's built-in loggers, each a :class:`~lockstep.callbacks.Callback`: CSV, JSON lines,
TensorBoard and MLflow. Public through :mod:`lockstep.callbacks`."""

from __future__ import annotations

import csv
import json
import os
from typing import Any

from lockstep._internal.output.callback_base import Callback, RunInfo, numeric_metrics
from lockstep.checkpoint import Checkpoint


class JSONLogger(Callback):
    """Appends each report as one JSON object (``report_index`` plus the metrics) to a file.

    Args:
        path: The file; default ``<log_dir>/metrics.jsonl``.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._chosen_path = path  # None: each run's own default (one logger may serve several fits)
        self._file: Any = None

    def on_run_start(self, run: RunInfo) -> None:
        self.path = self._chosen_path or os.path.join(run.log_dir, "metrics.jsonl")
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
        self._chosen_path = path  # None: each run's own default (one logger may serve several fits)
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []

    def on_run_start(self, run: RunInfo) -> None:
        self.path = self._chosen_path or os.path.join(run.log_dir, "metrics.csv")
        self._rows, self._columns = [], []
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
        self._chosen_dir = log_dir  # None: each run's own default (one logger may serve several fits)
        self._writer: Any = None

    def on_run_start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = self._chosen_dir or os.path.join(run.log_dir, "tensorboard")
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

    def __init__(
        self, tracking_uri: str | None = None, experiment_name: str = "lockstep", tags: dict[str, str] | None = None
    ) -> None:
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
        tags = {
            "mlflow.runName": run.name,
            "lockstep.path": run.path,
            "lockstep.world_size": str(run.world_size),
            **self.tags,
        }
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
