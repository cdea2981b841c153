"""The Prometheus metric families lockstep exports, built at scrape time from the runs' figures
(:class:`~lockstep._internal.output.metrics_state.RunMetrics`). Every name has the ``lockstep_``
prefix and its unit; every series of a run has its ``run`` label, per-rank series a ``rank``
label. :data:`FAMILIES` lists them (the docs' metrics table follows it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from lockstep._internal.output.metrics_state import Histogram, RunMetrics
from lockstep._internal.persist.retry_counts import retry_counts
from lockstep._internal.run.stragglers import PARTS

#: The run states ``lockstep_run_state`` has a series for.
RUN_STATES = ("starting", "running", "finished", "failed", "interrupted", "preempted", "stopped", "pruned")

#: (name as scraped, type, labels, meaning)
FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    ("lockstep_run_state", "gauge", "run, state", "1 for the run's state, 0 for the others"),
    ("lockstep_run_start_time_seconds", "gauge", "run", "when the run started (Unix time)"),
    ("lockstep_world_size", "gauge", "run", "workers in the current group"),
    ("lockstep_workers_alive", "gauge", "run", "workers of the group running now"),
    ("lockstep_reports_total", "counter", "run", "reports recorded"),
    ("lockstep_last_report_time_seconds", "gauge", "run", "when the last report was recorded (Unix time)"),
    ("lockstep_reported_metric", "gauge", "run, metric", "rank 0's latest reported numbers (the first 50 names)"),
    ("lockstep_step_time_seconds", "gauge", "run, rank", "the rank's latest time between two reports"),
    ("lockstep_step_part_seconds", "gauge", "run, rank, part", "its split: data, compute, collective, report"),
    ("lockstep_rank_time_seconds_total", "counter", "run, rank, part", "the split's running totals"),
    ("lockstep_rank_report_windows_total", "counter", "run, rank", "report windows the totals cover"),
    ("lockstep_rank_slow", "gauge", "run, rank", "1 for the rank that holds the others back"),
    ("lockstep_slow_rank_info", "gauge", "run, rank, cause", "1 while a rank is slow: why (data or compute)"),
    ("lockstep_report_round_trip_seconds", "histogram", "run", "what the last rank to reach a report waited"),
    ("lockstep_checkpoints_total", "counter", "run", "checkpoints committed"),
    ("lockstep_checkpoint_size_bytes", "gauge", "run", "the latest committed checkpoint's size"),
    ("lockstep_checkpoint_bytes_total", "counter", "run", "bytes of the checkpoints committed"),
    ("lockstep_checkpoint_upload_seconds", "histogram", "run", "a rank's checkpoint write, start to end"),
    ("lockstep_restarts_total", "counter", "run", "worker groups restarted after a failure"),
    ("lockstep_failures_total", "counter", "run", "failed attempts"),
    ("lockstep_preemption_notices_total", "counter", "run", "preemption notices (SIGTERM, node drains)"),
    ("lockstep_storage_retries_total", "counter", "operation", "storage operations tried again (this process)"),
)


def families_of(runs: Sequence[RunMetrics]) -> Iterator[Any]:
    """The metric families of ``runs`` (each family once, with a series per run)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    made: dict[str, Any] = {}
    kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}
    for name, kind, labels, meaning in FAMILIES:
        made[name] = kinds[kind](name, meaning, labels=[label.strip() for label in labels.split(",")])
    for run in runs:
        with run.lock:
            _add_run(made, run)
    for operation, count in sorted(retry_counts().items()):
        made["lockstep_storage_retries_total"].add_metric([operation], count)
    yield from made.values()


def _add_run(made: dict[str, Any], run: RunMetrics) -> None:
    """Add one run's series (the caller holds its lock)."""
    name = run.name
    for state in RUN_STATES:
        made["lockstep_run_state"].add_metric([name, state], float(run.state == state))
    for family, value in (
        ("lockstep_run_start_time_seconds", run.started_at),
        ("lockstep_world_size", run.world_size),
        ("lockstep_workers_alive", run.workers_alive),
        ("lockstep_reports_total", run.reports),
        ("lockstep_checkpoints_total", run.checkpoints),
        ("lockstep_checkpoint_bytes_total", run.checkpoint_bytes_total),
        ("lockstep_restarts_total", run.restarts),
        ("lockstep_failures_total", run.failures),
        ("lockstep_preemption_notices_total", run.preemption_notices()),
    ):
        made[family].add_metric([name], float(value))
    if run.last_report_at is not None:
        made["lockstep_last_report_time_seconds"].add_metric([name], run.last_report_at)
    if run.latest_checkpoint_bytes is not None:
        made["lockstep_checkpoint_size_bytes"].add_metric([name], float(run.latest_checkpoint_bytes))
    for metric, value in run.reported.items():
        made["lockstep_reported_metric"].add_metric([name, metric], value)
    _add_histogram(made["lockstep_report_round_trip_seconds"], name, run.round_trip)
    _add_histogram(made["lockstep_checkpoint_upload_seconds"], name, run.upload)
    _add_ranks(made, run)


def _add_histogram(family: Any, name: str, histogram: Histogram) -> None:
    family.add_metric([name], buckets=histogram.cumulative(), sum_value=histogram.total)


def _add_ranks(made: dict[str, Any], run: RunMetrics) -> None:
    slow_rank = run.slow[0] if run.slow is not None else None
    for rank, figures in sorted(run.ranks.items()):
        labels = [run.name, str(rank)]
        made["lockstep_step_time_seconds"].add_metric(labels, figures.latest.get("window", 0.0))
        for part in PARTS:
            made["lockstep_step_part_seconds"].add_metric([*labels, part], figures.latest.get(part, 0.0))
            made["lockstep_rank_time_seconds_total"].add_metric([*labels, part], figures.totals[part])
        made["lockstep_rank_report_windows_total"].add_metric(labels, float(figures.windows))
        made["lockstep_rank_slow"].add_metric(labels, float(rank == slow_rank))
    if run.slow is not None:
        made["lockstep_slow_rank_info"].add_metric([run.name, str(run.slow[0]), run.slow[1]], 1.0)
