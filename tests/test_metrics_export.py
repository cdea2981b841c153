"""Prometheus metrics: scraped from a real run's driver while the run goes on and just after it
ends; fits in one process share one port; the per-rank, round-trip and upload figures from the
ranks' messages; the port's checks."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from dashboard_runs import open_gate, start_gated_run, stop_gated_run, wait_for
from prometheus_client.parser import text_string_to_metric_families

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep._internal.output import metrics_export
from lockstep._internal.output.metrics_state import RunMetrics
from lockstep._internal.persist.retry_counts import count_retry
from lockstep._internal.rank.step_timing import StepTimes
from lockstep._internal.wire import protocol
from lockstep.torch import TorchTrainer


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of a metrics page by sample name (the page must parse as Prometheus' text format)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float | None:
    for found, number in samples.get(name, []):
        if all(found.get(key) == wanted for key, wanted in labels.items()):
            return number
    return None


def record_of(storage: str, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((Path(storage) / name / "lockstep_run.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.timeout(150)
def test_a_running_driver_serves_its_metrics_and_keeps_them_a_moment_after_the_end(tmp_path: Path) -> None:
    storage, gates = str(tmp_path / "results"), tmp_path / "gates"
    driver = start_gated_run(
        storage,
        "scraped",
        gates,
        workers=2,
        env={"LOCKSTEP_METRICS_PORT": "0", "LOCKSTEP_METRICS_HOST": "127.0.0.1", "LOCKSTEP_METRICS_LINGER_S": "2"},
    )
    try:
        url = wait_for(lambda: (record_of(storage, "scraped") or {}).get("metrics_url"), 90, "the record's metrics_url")
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        for gate in ("0", "1", "2", "3"):
            open_gate(gates, gate)
        running = wait_for(
            lambda: (lambda s: s if value(s, "lockstep_reports_total", run="scraped") == 4 else None)(scrape(url)),
            60,
            "four reports in the metrics",
        )
        assert value(running, "lockstep_run_state", run="scraped", state="running") == 1
        assert value(running, "lockstep_run_state", run="scraped", state="finished") == 0
        assert value(running, "lockstep_world_size", run="scraped") == 2
        assert value(running, "lockstep_workers_alive", run="scraped") == 2
        assert value(running, "lockstep_reported_metric", run="scraped", metric="loss") == 0.25
        for rank in ("0", "1"):
            assert value(running, "lockstep_step_time_seconds", run="scraped", rank=rank) > 0
            assert value(running, "lockstep_rank_report_windows_total", run="scraped", rank=rank) == 4
            assert value(running, "lockstep_rank_slow", run="scraped", rank=rank) == 0
            parts = {labels["part"] for labels, _ in running["lockstep_step_part_seconds"] if labels["rank"] == rank}
            assert parts == {"data", "compute", "collective", "report"}
        assert value(running, "lockstep_report_round_trip_seconds_count", run="scraped") == 3  # the first has no wait
        assert value(running, "lockstep_restarts_total", run="scraped") == 0
        assert all(name.startswith("lockstep_") for name in running)
        assert {
            "lockstep_run_start_time_seconds",
            "lockstep_last_report_time_seconds",
            "lockstep_checkpoints_total",
            "lockstep_checkpoint_upload_seconds_count",
            "lockstep_rank_time_seconds_total",
            "lockstep_failures_total",
            "lockstep_preemption_notices_total",
        } <= set(running)

        open_gate(gates, "finish")
        ended = wait_for(
            lambda: (lambda s: s if value(s, "lockstep_run_state", run="scraped", state="finished") == 1 else None)(
                scrape(url)
            ),
            60,
            "the finished state in the metrics",
        )
        assert value(ended, "lockstep_reports_total", run="scraped") == 4
        assert "metrics of run scraped: http://127.0.0.1:" in stop_gated_run(driver, gates)
        assert driver.returncode == 0
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()


def wait_at_gate(config: dict[str, Any]) -> None:
    lockstep.report({"loss": 1.0})
    deadline = time.monotonic() + 60
    while not os.path.exists(config["gate"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    lockstep.report({"loss": 0.5})


@pytest.mark.timeout(150)
def test_fits_in_one_driver_share_one_port_and_tell_their_runs_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(metrics_export.METRICS_HOST_ENV, "127.0.0.1")
    monkeypatch.setenv(metrics_export.METRICS_LINGER_ENV, "0.5")
    storage, gate = str(tmp_path / "results"), tmp_path / "gate"
    results: dict[str, Any] = {}

    def fit(name: str) -> None:
        trainer = TorchTrainer(
            wait_at_gate,
            train_loop_config={"gate": str(gate)},
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(name=name, storage_path=storage, metrics_port=0, verbose=0),
        )
        results[name] = trainer.fit()

    threads = [threading.Thread(target=fit, args=(name,)) for name in ("trial-a", "trial-b")]
    for thread in threads:
        thread.start()
    try:
        urls = wait_for(
            lambda: (lambda found: found if all(found) else None)(
                [(record_of(storage, name) or {}).get("metrics_url") for name in ("trial-a", "trial-b")]
            ),
            90,
            "two URLs",
        )
        assert urls[0] == urls[1], "two fits of one process got two servers"
        both = wait_for(
            lambda: (
                lambda s: (
                    s
                    if all(value(s, "lockstep_reports_total", run=name) == 1 for name in ("trial-a", "trial-b"))
                    else None
                )
            )(scrape(urls[0])),
            60,
            "both runs' first report",
        )
        assert value(both, "lockstep_run_state", run="trial-a", state="running") == 1
    finally:
        gate.touch()
        for thread in threads:
            thread.join(120)
    assert results["trial-a"].metrics == results["trial-b"].metrics == {"loss": 0.5}

    def closed() -> bool:
        try:
            scrape(urls[0])
        except (urllib.error.URLError, ConnectionError):
            return True
        return False

    wait_for(closed, 10, "the server to close once it serves no run")


# -- the figures, from events as the ranks send them -------------------------------------------------


def times(window: float, data: float, collective: float, report: float) -> StepTimes:
    return StepTimes(window_s=window, data_s=data, collective_s=collective, report_s=report)


def test_per_rank_figures_round_trips_uploads_and_the_slow_rank_come_from_the_ranks_messages() -> None:
    run = RunMetrics("unit")
    run.attempt_started(world_size=2, restart=False)
    for index in range(4):
        if index == 1:
            run.observe(
                [protocol.WritingCheckpoint(0, "checkpoint_000001"), protocol.WritingCheckpoint(1, "checkpoint_000001")]
            )
        slow = times(0.2, 0.12, 0.0, 0.002 if index else 0.0)
        waiting = times(0.2, 0.01, 0.11, 0.004 if index else 0.0)
        dir_name = "checkpoint_000001" if index == 1 else None
        run.observe([protocol.Report(1, index, None, dir_name, "written" if dir_name else None, step_times=slow)])
        run.observe([protocol.Report(0, index, "{}", dir_name, "uploading" if dir_name else None, step_times=waiting)])
        run.report_recorded(index, {"loss": 1.0 / (index + 1), "note": "text"})
    run.observe([protocol.CheckpointUploaded(0, 1, "checkpoint_000001")])

    assert run.reports == 4 and run.reported == {"loss": 0.25}
    assert run.ranks[1].windows == 4 and run.ranks[1].totals["data"] == pytest.approx(0.48)
    assert run.round_trip.counts[-1] == 0 and sum(run.round_trip.counts) == 3  # the last rank's wait, 2 ms
    assert run.round_trip.total == pytest.approx(0.006)
    assert sum(run.upload.counts) == 2, "rank 1's SYNC write ended with its report, rank 0's ASYNC one later"
    assert run.slow == (1, "data")


def test_storage_retries_are_counted_for_the_metrics() -> None:
    run = RunMetrics("retries")
    count_retry("test_operation")
    count_retry("test_operation")
    from lockstep._internal.output.metrics_families import families_of

    families = {family.name: family for family in families_of([run])}
    retries = {tuple(sample.labels.items()): sample.value for sample in families["lockstep_storage_retries"].samples}
    assert retries[(("operation", "test_operation"),)] >= 2


# -- the port -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", [-1, 65536, True, 1.5, "9100"])
def test_a_metrics_port_that_is_not_a_port_is_refused(port: Any) -> None:
    with pytest.raises(ValueError, match="RunConfig.metrics_port must be a TCP port number"):
        RunConfig(metrics_port=port)


def test_a_metrics_port_from_the_environment_is_checked_and_unset_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(metrics_export.METRICS_PORT_ENV, raising=False)
    assert metrics_export.metrics_port(RunConfig()) is None
    monkeypatch.setenv(metrics_export.METRICS_PORT_ENV, "9464")
    assert metrics_export.metrics_port(RunConfig()) == 9464
    assert metrics_export.metrics_port(RunConfig(metrics_port=0)) == 0, "RunConfig wins over the environment"
    monkeypatch.setenv(metrics_export.METRICS_PORT_ENV, "ninety")
    with pytest.raises(ValueError, match="LOCKSTEP_METRICS_PORT must be a TCP port number"):
        metrics_export.metrics_port(RunConfig())


def test_a_port_another_process_holds_leaves_the_run_without_metrics(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(metrics_export.METRICS_HOST_ENV, "127.0.0.1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING):
            assert metrics_export.start_exporter(RunConfig(metrics_port=port), "blocked", lambda: 0) is None
    assert f"port {port} can't be bound" in caplog.text
