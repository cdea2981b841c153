"""What the Prometheus exporter knows of one run: plain numbers, updated by the run's listener
hooks and by the tap on its worker group's events (both in the controller's thread, a few
dictionary writes each), and read under a lock by the metrics server's thread when it is
scraped (:mod:`lockstep._internal.output.metrics_export` turns them into metric families).

Per rank, from the step times each rank sends with its reports
(:mod:`lockstep._internal.rank.step_timing`): the latest time between two reports and its
split, and running totals of each part. A checkpoint's upload time is, per rank, from its
``WritingCheckpoint`` message to its report (SYNC) or to its ``CheckpointUploaded`` (ASYNC), as
the driver sees them arrive.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.rank.step_timing import StepTimes
from lockstep._internal.run.stragglers import PARTS, RECENT_REPORTS, RankTimes, slowest_rank
from lockstep._internal.wire import protocol
from lockstep.callbacks import numeric_metrics

#: Seconds; the buckets of the round-trip and upload histograms.
ROUND_TRIP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UPLOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: At most this many reported metrics are exported per run (the first seen).
MAX_REPORTED_METRICS = 50


@dataclass
class Histogram:
    """Observations counted into cumulative buckets, as Prometheus' histograms are."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs, the last one ``+Inf``."""
        pairs, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            pairs.append((bound, running))
        return pairs


@dataclass
class RankFigures:
    """One rank's latest report window and its running totals (seconds per part)."""

    latest: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    windows: int = 0


class RunMetrics:
    """The exported state of one run (see the module's docstring)."""

    def __init__(self, name: str, preemption_notices: Callable[[], int] = lambda: 0) -> None:
        self.name = name
        self.preemption_notices = preemption_notices
        self.lock = threading.Lock()
        self.started_at = time.time()
        self.state = "starting"
        self.world_size = 0
        self.workers_alive = 0
        self.reports = 0
        self.last_report_at: float | None = None
        self.restarts = 0
        self.failures = 0
        self.checkpoints = 0
        self.checkpoint_bytes_total = 0
        self.latest_checkpoint_bytes: int | None = None
        self.round_trip = Histogram(ROUND_TRIP_BUCKETS)
        self.upload = Histogram(UPLOAD_BUCKETS)
        self.ranks: dict[int, RankFigures] = {}
        self.slow: tuple[int, str] | None = None
        self.reported: dict[str, float] = {}
        self._step_times: dict[int, dict[int, StepTimes]] = {}
        self._recent: deque[Mapping[str, RankTimes]] = deque(maxlen=RECENT_REPORTS)
        self._writing_since: dict[tuple[int, str], float] = {}

    # -- the worker group's events (the tap) ----------------------------------------------------

    def observe(self, events: Sequence[Any]) -> None:
        """Take what the ranks said: step times and checkpoint writes."""
        with self.lock:
            for event in events:
                if isinstance(event, protocol.Report):
                    self._on_report(event)
                elif isinstance(event, protocol.WritingCheckpoint):
                    self._writing_since.setdefault((event.rank, event.dir_name), time.monotonic())
                elif isinstance(event, protocol.CheckpointUploaded):
                    self._upload_ended(event.rank, event.dir_name)

    def _on_report(self, report: protocol.Report) -> None:
        if report.step_times is not None:
            self._step_times.setdefault(report.index, {})[report.rank] = report.step_times
        if report.checkpoint_dir_name is not None and report.checkpoint_state != "uploading":
            self._upload_ended(report.rank, report.checkpoint_dir_name)

    def _upload_ended(self, rank: int, dir_name: str) -> None:
        started = self._writing_since.pop((rank, dir_name), None)
        if started is not None:
            self.upload.observe(time.monotonic() - started)

    # -- the listener's hooks -------------------------------------------------------------------

    def attempt_started(self, world_size: int, restart: bool) -> None:
        """A worker group of ``world_size`` starts (after a failure when ``restart``)."""
        with self.lock:
            self.state, self.world_size, self.workers_alive = "running", world_size, 0
            self.restarts += restart
            self._step_times.clear()
            self._writing_since.clear()

    def report_recorded(self, index: int, metrics: Mapping[str, Any]) -> None:
        """Report ``index`` is recorded: count it and take its ranks' step times."""
        with self.lock:
            self.reports += 1
            self.last_report_at = time.time()
            for name, value in numeric_metrics(dict(metrics)).items():
                if name in self.reported or len(self.reported) < MAX_REPORTED_METRICS:
                    self.reported[name] = value
            times = self._step_times.pop(index, None)
            if times:
                self._take_step_times(times)

    def _take_step_times(self, times: Mapping[int, StepTimes]) -> None:
        record: dict[str, RankTimes] = {}
        for rank, step in times.items():
            parts = {
                "data": step.data_s,
                "collective": step.collective_s,
                "report": step.report_s,
                "compute": step.compute_s,
            }
            figures = self.ranks.setdefault(rank, RankFigures())
            figures.latest = {"window": step.window_s, **parts}
            figures.windows += 1
            for part, seconds in parts.items():
                figures.totals[part] += seconds
            record[str(rank)] = {"window": step.window_s, **parts}
        waits = [step.report_s for step in times.values()]
        if len(times) == self.world_size and min(waits) > 0:
            self.round_trip.observe(min(waits))  # what the last rank to arrive waited
        self._recent.append(record)
        slow = slowest_rank(self._recent)
        self.slow = (slow.rank, slow.cause) if slow is not None else None

    def checkpoint_committed(self) -> None:
        """One more checkpoint is committed (its size comes later: :meth:`checkpoint_measured`)."""
        with self.lock:
            self.checkpoints += 1

    def checkpoint_measured(self, size_bytes: int) -> None:
        """The size of the latest committed checkpoint, in bytes."""
        with self.lock:
            self.latest_checkpoint_bytes = size_bytes
            self.checkpoint_bytes_total += size_bytes

    def workers_changed(self, alive: int) -> None:
        """``alive`` workers of the group are running."""
        with self.lock:
            self.workers_alive = alive

    def failed(self) -> None:
        """An attempt failed."""
        with self.lock:
            self.failures += 1

    def ended(self, status: str) -> None:
        """The run ended with ``status``."""
        with self.lock:
            self.state, self.workers_alive = status, 0
