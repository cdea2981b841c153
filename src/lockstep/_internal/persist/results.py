"""A run's record as a :class:`~lockstep.Result` sees it, and a run's error as the record keeps
it (``Result.from_path``, the run recorder and ``lockstep show`` build Results with these)."""

from __future__ import annotations

from typing import Any

from lockstep._internal.persist.storage import CheckpointEntry, RunStorage
from lockstep.errors import TrainingFailedError, WorkerFailure


def result_fields(
    run: RunStorage, record: dict[str, Any], reports: list[dict[str, Any]], return_value: Any = None
) -> dict[str, Any]:
    """The fields of the :class:`~lockstep.Result` of a run record and its report history."""
    entries = {entry["dir_name"]: CheckpointEntry(**entry) for entry in record.get("checkpoints", [])}
    latest = list(entries.values())[-1] if entries else None  # the record lists them in commit order
    best = [entries[name] for name in record.get("best_checkpoints", entries)]  # a record of 0.1.0 has none
    return dict(
        metrics=_last_metrics(reports, latest),
        checkpoint=run.checkpoint_of(latest) if latest is not None else None,
        error=error_from_record(record.get("error")),
        path=run.display_path,
        filesystem=run.filesystem,
        best_checkpoints=[(run.checkpoint_of(entry), entry.metrics) for entry in best],
        return_value=return_value,
        num_failures=int(record.get("num_failures", 0)),
        metrics_history=[history_row(report) for report in reports],
    )


def _last_metrics(reports: list[dict[str, Any]], latest: CheckpointEntry | None) -> dict[str, Any] | None:
    """The last report's metrics; when that report's checkpoint was validated, with its
    validation's metrics (as Ray Train, whose Result.metrics are the latest checkpoint's)."""
    if not reports:
        return None
    last = reports[-1]
    if latest is not None and latest.report_index == last["report_index"]:
        return {**last["metrics"], **latest.metrics}
    return dict(last["metrics"])


def history_row(report: dict[str, Any]) -> dict[str, Any]:
    """A report as one metrics_dataframe row."""
    return {
        **report["metrics"],
        "report_index": report["report_index"],
        "timestamp": report["timestamp"],
        "checkpoint_dir_name": report.get("checkpoint_dir_name"),
    }


def error_to_record(error: BaseException | None) -> dict[str, Any] | None:
    """The error as the run record stores it."""
    if error is None:
        return None
    failures = getattr(error, "failures", {}) or {}
    return {
        "type": type(error).__name__,
        "message": str(error),
        "failures": [vars(failure) for failure in failures.values()],
    }


def error_from_record(data: dict[str, Any] | None) -> TrainingFailedError | None:
    """The error of a run record, as a TrainingFailedError."""
    if not data:
        return None
    failures = {item["rank"]: WorkerFailure(**item) for item in data.get("failures", [])}
    return TrainingFailedError(data["message"], failures)
