"""What each dashboard page asks for, as JSON-ready dicts: the runs list, one run (record, rank
table, checkpoints, error, config), its reports since a position, its log tails."""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

from lockstep._internal.persist.run_status import shown_status
from lockstep._internal.run.stragglers import PARTS, rank_shares, slowest_rank
from lockstep.dashboard.history import ReportHistory
from lockstep.dashboard.store import RunStore

__all__ = ["json_safe", "run_detail", "run_rows"]

#: (config key naming the total, metric naming the position): a run's progress, when it has both.
PROGRESS_PAIRS = (
    (("epochs", "num_epochs", "max_epochs"), ("epoch",)),
    (("steps", "num_steps", "max_steps", "total_steps"), ("step", "global_step", "training_iteration")),
)
#: The checkpoints a run page lists beyond the kept ones (the latest reported).
SHOWN_DELETED_CHECKPOINTS = 50


def run_rows(store: RunStore) -> list[dict[str, Any]]:
    """One row per run under the storage path (the runs list)."""
    return [run_row(name, record, store.history(name, record)) for name, record in store.records().items()]


def run_row(name: str, record: Mapping[str, Any], history: ReportHistory) -> dict[str, Any]:
    """A run as the runs list shows it."""
    status = shown_status(dict(record))
    with history.lock:
        metrics = {
            metric: {"last": _last(column), "min": low, "max": high}
            for metric, column in history.columns.items()
            for low, high in [history.extremes.get(metric, (None, None))]
        }
        reports, last_at = len(history.indices), (history.times[-1] if history.times else None)
        last_metrics = dict(history.last_metrics)
    checkpoint_config = ((record.get("config") or {}).get("run_config") or {}).get("checkpoint_config") or {}
    return {
        "name": name,
        "status": status,
        "created_at": _epoch(record.get("created_at")),
        "updated_at": _epoch(record.get("updated_at")),
        "reports": reports,
        "last_report_at": last_at,
        "progress": 1.0 if status == "finished" else progress(record, last_metrics),
        "metrics": metrics,
        "score_attribute": checkpoint_config.get("checkpoint_score_attribute"),
        "score_order": checkpoint_config.get("checkpoint_score_order", "max"),
        "world_size": record.get("world_size"),
        "executor": record.get("executor"),
        "checkpoints": len(record.get("checkpoints") or []),
        "error": ((record.get("error") or {}).get("message") or "").split("\n", 1)[0][:200],
    }


def progress(record: Mapping[str, Any], last_metrics: Mapping[str, Any]) -> float | None:
    """How far a run is, where its ``train_loop_config`` names a total (``epochs``, ``max_steps``,
    ...) and its last report the position (``epoch``, ``step``, ...); else None."""
    loop_config = (record.get("config") or {}).get("train_loop_config") or {}
    for totals, positions in PROGRESS_PAIRS:
        total = next((loop_config[key] for key in totals if _is_number(loop_config.get(key))), None)
        position = next((last_metrics[key] for key in positions if _is_number(last_metrics.get(key))), None)
        if total and position is not None:
            return max(0.0, min(1.0, (position + 1) / total))
    return None


def run_detail(store: RunStore, name: str) -> dict[str, Any]:
    """Everything a run page shows but the curves and the logs."""
    record = store.record(name)
    history = store.history(name, record)
    status = shown_status(record)
    with history.lock:
        recent = list(history.recent_step_times)
        reported = list(history.checkpoints)
        metric_names, reports = list(history.columns), len(history.indices)
    slow = slowest_rank(recent)
    return {
        **{key: record.get(key) for key in ("world_size", "executor", "driver", "metrics_url", "stop_reason")},
        **{key: record.get(key) for key in ("num_failures", "num_preemptions", "config", "heartbeat_at")},
        "name": name,
        "status": status,
        "path": store.run(name).display_path,
        "created_at": _epoch(record.get("created_at")),
        "updated_at": _epoch(record.get("updated_at")),
        "reports": reports,
        "metric_names": metric_names,
        "error": record.get("error"),
        "ranks": rank_rows(record, recent, status),
        "slow_rank": {"rank": slow.rank, "cause": slow.cause, "share": slow.share} if slow else None,
        "checkpoints": checkpoint_rows(store, name, record, reported),
    }


def rank_rows(record: Mapping[str, Any], recent: list[Any], status: str) -> list[dict[str, Any]]:
    """The rank table: status, host, time between reports and its split (shares), slow flag."""
    shares = rank_shares(recent)
    slow = slowest_rank(recent)
    roster = record.get("ranks") or {}
    failed = {
        int(item["rank"]): item.get("error_type", "failed") for item in (record.get("error") or {}).get("failures", [])
    }
    world_size = int(record.get("world_size") or 0)
    known = {*map(int, roster), *shares, *range(world_size)}
    ranks = sorted(rank for rank in known if not world_size or rank < world_size)  # not those of a larger group before
    driver_host = (record.get("driver") or {}).get("host")
    rows = []
    for rank in ranks:
        placed = roster.get(str(rank)) or {}
        share = shares.get(rank, {})
        rows.append(
            {
                "rank": rank,
                "status": f"failed ({failed[rank]})" if rank in failed else _rank_status(status),
                "host": placed.get("host") or (driver_host if record.get("executor") == "local" else None),
                "pid": placed.get("pid"),
                "step_s": share.get("step_s"),
                "shares": {part: share.get(part) for part in PARTS} if share else None,
                "slow": slow is not None and slow.rank == rank,
            }
        )
    return rows


def _rank_status(run_status: str) -> str:
    return {"failed": "stopped", "lost": "unknown"}.get(run_status, run_status)


def checkpoint_rows(
    store: RunStore, name: str, record: Mapping[str, Any], reported: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The checkpoints: every kept one (with its size and scores) and the latest reported ones
    that retention deleted."""
    kept = {entry["dir_name"]: entry for entry in record.get("checkpoints") or []}
    best = set(record.get("best_checkpoints") or [])
    deleted = [item for item in reported if item["dir_name"] not in kept][-SHOWN_DELETED_CHECKPOINTS:]
    rows = []
    for entry in sorted([*kept.values(), *deleted], key=lambda item: item["report_index"]):
        is_kept = entry["dir_name"] in kept
        rows.append(
            {
                "dir_name": entry["dir_name"],
                "report_index": entry["report_index"],
                "kept": is_kept,
                "best": entry["dir_name"] in best,
                "latest": entry["dir_name"] == record.get("latest_checkpoint"),
                "metrics": entry.get("metrics") or {},
                "validation": entry.get("validation"),
                "path": entry.get("path"),
                "size_bytes": store.checkpoint_size(name, entry["dir_name"], entry.get("path")) if is_kept else None,
            }
        )
    return rows


def json_safe(value: Any) -> Any:
    """``value`` with every float that JSON can't carry (NaN, infinities) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _last(column: list[float | None]) -> float | None:
    return next((value for value in reversed(column) if value is not None), None)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _epoch(stamp: Any) -> float | None:
    """An ISO time of the record as Unix time."""
    try:
        return datetime.datetime.fromisoformat(str(stamp)).timestamp()
    except ValueError:
        return None
