"""One run's report history (``reports.jsonl``) as the dashboard keeps it: read once, then only
the bytes added since (the file only grows while a run goes on: appended on local disk, and
rewritten whole with the same beginning on object stores), in columns ready for the charts.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from lockstep._internal.persist.storage import REPORTS_FILE, RunStorage
from lockstep._internal.run.stragglers import RECENT_REPORTS, RankTimes
from lockstep.callbacks import numeric_metrics

__all__ = ["ReportHistory"]

logger = logging.getLogger(__name__)


class ReportHistory:
    """The reports of one run, in columns: ``indices``, ``times`` and, per numeric metric, its
    values (``None`` where a report lacks it); plus the reports that named a checkpoint and the
    ranks' step times of the latest reports.

    Args:
        storage: The run folder.
    """

    def __init__(self, storage: RunStorage) -> None:
        self.storage = storage
        self.path = storage.path_of(REPORTS_FILE)
        self.lock = threading.Lock()
        self.run_created_at: str | None = None
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self.indices: list[int] = []
        self.times: list[float] = []
        self.columns: dict[str, list[float | None]] = {}
        self.extremes: dict[str, tuple[float, float]] = {}
        self.last_metrics: dict[str, Any] = {}
        self.checkpoints: list[dict[str, Any]] = []
        self.recent_step_times: deque[Mapping[str, RankTimes]] = deque(maxlen=RECENT_REPORTS)

    def refresh(self, run_created_at: str | None = None) -> None:
        """Read what was added to the file since the last call (all of it again when the run's
        record says it was created anew: ``run_created_at`` differs from the last one given)."""
        with self.lock:
            if run_created_at is not None and run_created_at != self.run_created_at:
                self._reset()
                self.run_created_at = run_created_at
            added = self._read_added()
            for line in added:
                self._add(line)

    def _read_added(self) -> list[str]:
        filesystem = self.storage.filesystem
        filesystem.invalidate_cache(self.path)
        try:
            size = int(filesystem.size(self.path))
        except FileNotFoundError:
            return []
        if size < self.offset:  # not the file read before (deleted and started again)
            self._reset()
        if size == self.offset:
            return []
        with filesystem.open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read(size - self.offset)
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self.offset += len(complete)
        return complete.decode("utf-8", errors="replace").splitlines()

    def _add(self, line: str) -> None:
        try:
            report = json.loads(line)
            index, timestamp, metrics = int(report["report_index"]), float(report["timestamp"]), report["metrics"]
        except (ValueError, KeyError, TypeError):
            logger.debug("skipped a line of %s that is not a report: %.80s", self.path, line)
            return
        numbers = numeric_metrics(metrics) if isinstance(metrics, dict) else {}
        row = len(self.indices)
        self.indices.append(index)
        self.times.append(timestamp)
        for name, value in numbers.items():
            column = self.columns.setdefault(name, [None] * row)
            if not math.isfinite(value):  # NaN and infinities: a gap in the curve (JSON has no such numbers)
                column.append(None)
                continue
            column.append(value)
            low, high = self.extremes.get(name, (value, value))
            self.extremes[name] = (min(low, value), max(high, value))
        for column in self.columns.values():
            if len(column) == row:
                column.append(None)
        self.last_metrics = metrics if isinstance(metrics, dict) else {}
        if report.get("checkpoint_dir_name"):
            dir_name = report["checkpoint_dir_name"]
            self.checkpoints.append({"dir_name": dir_name, "report_index": index, "metrics": numbers})
        if report.get("step_times"):
            self.recent_step_times.append(report["step_times"])

    def rows_since(self, start: int) -> dict[str, Any]:
        """The reports from position ``start`` on, as columns (what a chart adds to itself)."""
        with self.lock:
            start = max(0, min(start, len(self.indices)))
            return {
                "start": start,
                "count": len(self.indices),
                "index": self.indices[start:],
                "time": self.times[start:],
                "metrics": {name: column[start:] for name, column in self.columns.items()},
            }
