"""Runs for the dashboard's tests, written by lockstep's own code: a long run's record and history
(the run recorder, as the driver uses it, fed reports with two ranks' step times), and a driver
script whose run reports each time the test lets it (tests/scripts/gated_run.py)."""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.run.run_record import RunRecorder
from lockstep.config import CheckpointConfig

GATED_RUN = Path(__file__).parent / "scripts" / "gated_run.py"


def write_long_run(storage_path: str, name: str, reports: int = 10_000, world_size: int = 2) -> RunStorage:
    """A finished run of ``reports`` reports by ``world_size`` ranks (the last one slower to load
    its data, the others waiting for it in the collectives), with a checkpoint every 1,000 reports
    (two kept), recorded as the driver records them."""
    storage = RunStorage.for_run(storage_path, name)
    recorder = RunRecorder(
        storage,
        CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"),
        world_size,
    )
    recorder.open({"config": {"train_loop_config": {"lr": 0.05, "steps": reports}}, "metrics_url": None})
    for rank in range(world_size):
        recorder.note_rank(rank, f"trainer-{rank}", 1000 + rank)
    for index in range(reports):
        loss = 2.0 * math.exp(-index / 2500) + 0.05 * math.sin(index / 40)
        metrics = {"step": index, "loss": loss, "accuracy": 1 - loss / 2.5, "lr": 0.05 * 0.999 ** (index // 10)}
        step_times = {
            str(rank): {"window": 0.2, "data": 0.02, "collective": 0.11, "report": 0.002} for rank in range(world_size)
        }
        step_times[str(world_size - 1)] = {"window": 0.2, "data": 0.1, "collective": 0.03, "report": 0.002}
        dir_name = f"checkpoint_{index:06d}" if index % 1000 == 999 else None
        if dir_name is not None:
            with tempfile.TemporaryDirectory() as local:
                Path(local, "model.pt").write_bytes(os.urandom(4096))
                storage.write_checkpoint(local, dir_name)
        report = recorder.log_report(index, json.dumps(metrics), dir_name, step_times)
        if dir_name is not None:
            recorder.commit_checkpoint(dir_name, index, report["metrics"])
    recorder.finish("finished")
    return storage


def start_gated_run(
    storage_path: str, name: str, gates: Path, workers: int = 1, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """A driver running ``name`` whose train function reports once per file ``gates/<n>`` that
    appears (n = 0, 1, ...) and returns when ``gates/finish`` appears (see scripts/gated_run.py)."""
    gates.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(GATED_RUN), storage_path, name, str(gates), str(workers)],
        env={**os.environ, "LOCKSTEP_WARM_START": "0", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def open_gate(gates: Path, gate: str) -> None:
    """Let the gated run make its next report (``gate`` = its number) or finish (``"finish"``)."""
    (gates / gate).touch()


def stop_gated_run(driver: subprocess.Popen[str], gates: Path, timeout_s: float = 60) -> str:
    """Let the run finish and wait for its driver (killed if it does not end in time); its output."""
    open_gate(gates, "finish")
    try:
        output, _ = driver.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        driver.kill()
        output, _ = driver.communicate()
    return output


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll ``condition()`` until it returns something true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


def start_dashboard(
    storage_path: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 60
) -> tuple[subprocess.Popen[str], str]:
    """``lockstep dashboard --storage STORAGE --port 0 ARGS`` and the URL it printed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "lockstep.cli", "dashboard", "--storage", storage_path, "--port", "0", *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline() if ready else ""
    if not line.startswith("dashboard: "):
        process.kill()
        _, errors = process.communicate()
        raise AssertionError(f"the dashboard did not start: {line!r} {errors}")
    return process, line.split(" ", 1)[1].strip()


def stop(process: subprocess.Popen[str]) -> None:
    """End a process this test started, and reap it."""
    if process.poll() is None:
        process.kill()
    process.communicate()
