"""Preemption notices (SIGTERM) and no stale ``running`` record: real driver scripts and
torchrun groups, signals sent by the test (see lockstep._internal.run.preemption)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, tagged_processes_after
from test_scripts import SCRIPTS, free_port

JOB = str(SCRIPTS / "preemptible_job.py")
HANGUP_JOB = str(SCRIPTS / "hangup_job.py")


class Job:
    """One run of preemptible_job.py (or ``script``, which takes the same first two arguments and
    names its run the same) in ``tmp_path``: the driver process and its run folder."""

    def __init__(self, tmp_path: Path, *args: str, torchrun: bool = False, script: str = JOB) -> None:
        self.run = tmp_path / "results" / "preemptible"
        self.pids = tmp_path / "pids"
        self.pids.mkdir(exist_ok=True)
        launcher = (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                "--rdzv_backend=static",
                f"--master_port={free_port()}",
                "--max-restarts=0",
            ]
            if torchrun
            else [sys.executable]
        )
        self.process = subprocess.Popen(
            [*launcher, script, str(tmp_path / "results"), str(self.pids), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )

    def reports(self) -> list[dict]:
        path = self.run / "reports.jsonl"
        text = path.read_text() if path.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def record(self) -> dict:
        return json.loads((self.run / "lockstep_run.json").read_text())

    def wait_for_reports(self, count: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while len(self.reports()) < count:
            assert self.process.poll() is None, self.output()
            assert time.monotonic() < deadline, "the run did not report in time"
            time.sleep(0.05)

    def rank_pid(self, rank: int) -> int:
        return int((self.pids / f"rank{rank}").read_text())

    def finish(self, timeout: float = 60) -> tuple[int, dict[str, dict]]:
        """Wait for the driver; return its exit code and each process's RESULT line."""
        try:
            self.stdout, self.stderr = self.process.communicate(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.communicate()
        results = {}
        for line in self.stdout.splitlines():
            if line.startswith("RESULT "):
                _, who, text = line.split(" ", 2)
                results[who] = json.loads(text)
        return self.process.returncode, results

    def output(self) -> str:
        return "(the driver ended early)"


def assert_nothing_left() -> None:
    assert tagged_processes_after(time.monotonic() + 10) == [], "processes left after the run stopped"


def checkpoint_step(run: Path, record: dict) -> int:
    return int((run / record["latest_checkpoint"] / "step.txt").read_text())


@pytest.mark.timeout(150)
def test_sigterm_to_the_driver_stops_at_the_next_checkpoint_and_the_rerun_continues(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "5", "--steps", "20")
    job.wait_for_reports(2)
    job.process.send_signal(signal.SIGTERM)
    noticed_at = time.monotonic()
    code, results = job.finish()
    assert time.monotonic() - noticed_at < 20, "the run should stop at its next checkpoint, well within the grace"
    assert code == 0, job.stderr
    assert results["driver"]["error"] == "PreemptionError", job.stderr
    assert results["driver"]["ranks"] == [0, 1] and results["driver"]["drain_timed_out"] is False
    record = job.record()
    assert record["status"] == "preempted" and record.get("num_failures", 0) == 0
    reports = job.reports()
    assert reports[-1]["checkpoint_dir_name"] == record["latest_checkpoint"], "it stopped at the committed checkpoint"
    noticed = [report for report in reports if report["metrics"]["notice"]]
    assert noticed and noticed[0]["metrics"]["notice"] == [0, 1], "the ranks learned of the notice in report()"
    assert noticed[0]["metrics"]["deadline_ms"] > time.time() * 1000 - 60_000
    stopped_at = checkpoint_step(job.run, record)
    assert stopped_at < 19
    assert_nothing_left()

    rerun = Job(tmp_path, "--every", "5", "--steps", "20")
    code, results = rerun.finish(timeout=90)
    assert code == 0 and results["driver"]["error"] is None, rerun.stderr
    assert results["driver"]["steps"] == list(range(stopped_at + 1)) + list(range(stopped_at + 1, 20))
    record = rerun.record()
    assert record["status"] == "finished" and record.get("num_failures", 0) == 0 and record["num_preemptions"] == 1


@pytest.mark.timeout(120)
def test_a_second_sigterm_stops_at_once_with_the_record_right(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "3", "--step-s", "0.2")
    job.wait_for_reports(4)  # a checkpoint is committed (step 2)
    job.process.send_signal(signal.SIGTERM)
    job.wait_for_reports(len(job.reports()) + 1)
    checkpoints_before = job.record()["latest_checkpoint"]
    job.process.send_signal(signal.SIGTERM)
    sent_at = time.monotonic()
    code, results = job.finish()
    assert time.monotonic() - sent_at < 5, "a second SIGTERM stops the run at once"
    assert results["driver"]["error"] == "PreemptionError", job.stderr
    record = job.record()
    assert record["status"] == "preempted" and record["latest_checkpoint"] is not None
    assert record["latest_checkpoint"] >= checkpoints_before
    assert (job.run / record["latest_checkpoint"] / "step.txt").exists(), "the latest checkpoint is intact"
    assert_nothing_left()


@pytest.mark.timeout(120)
def test_when_the_grace_runs_out_the_run_stops_preempted(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "3", "--step-s", "0.2", "--grace", "2")
    job.wait_for_reports(4)
    job.process.send_signal(signal.SIGTERM)
    sent_at = time.monotonic()
    # no checkpoint comes in time? with every=3 one would: slow the next one down by stopping rank 1
    os.kill(job.rank_pid(1), signal.SIGSTOP)
    try:
        code, results = job.finish()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.rank_pid(1), signal.SIGCONT)
    assert 1.5 < time.monotonic() - sent_at < 8
    assert results["driver"]["error"] == "PreemptionError" and results["driver"]["drain_timed_out"] is True, job.stderr
    assert "preemption_grace_s=2 ran out" in results["driver"]["message"]
    record = job.record()
    assert record["status"] == "preempted" and record.get("num_failures", 0) == 0
    assert (job.run / record["latest_checkpoint"] / "step.txt").exists()
    assert_nothing_left()


@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_is_a_notice_for_that_rank(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "5", "--steps", "40")
    job.wait_for_reports(2)
    os.kill(job.rank_pid(1), signal.SIGTERM)
    code, results = job.finish()
    assert results["driver"]["error"] == "PreemptionError", job.stderr
    assert results["driver"]["ranks"] == [1]
    record = job.record()
    assert record["status"] == "preempted"
    assert job.reports()[-1]["checkpoint_dir_name"] == record["latest_checkpoint"]
    assert [report["metrics"]["notice"] for report in job.reports() if report["metrics"]["notice"]][0] == [1]
    assert_nothing_left()


@pytest.mark.timeout(120)
def test_sigterm_in_local_mode_is_a_notice_too(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "5", "--steps", "40", "--num-workers", "0")
    job.wait_for_reports(2)
    job.process.send_signal(signal.SIGTERM)
    code, results = job.finish()
    assert results["driver"]["error"] == "PreemptionError" and results["driver"]["ranks"] == [0], job.stderr
    record = job.record()
    assert record["status"] == "preempted" and record["executor"] == "local_mode"
    assert job.reports()[-1]["checkpoint_dir_name"] == record["latest_checkpoint"]


@pytest.mark.timeout(150)
def test_sigterm_to_torchrun_stops_every_rank_with_a_preemption_error(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "5", "--steps", "40", torchrun=True)
    job.wait_for_reports(2)
    job.process.send_signal(signal.SIGTERM)
    code, results = job.finish(timeout=60)
    assert code != 0  # torchrun itself ends with the signal
    assert sorted(results) == ["0", "1"], job.stdout + job.stderr
    for rank in ("0", "1"):
        assert results[rank]["error"] == "PreemptionError", results[rank]
    assert results["0"]["ranks"] == [0, 1]
    record = job.record()
    assert record["status"] == "preempted" and record["executor"] == "external"
    assert job.reports()[-1]["checkpoint_dir_name"] == record["latest_checkpoint"]
    assert_nothing_left()


@pytest.mark.timeout(120)
def test_lockstep_runs_shows_a_killed_drivers_run_as_lost(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "5")
    job.wait_for_reports(1)
    job.process.send_signal(signal.SIGKILL)
    job.finish()
    assert_nothing_left()
    assert job.record()["status"] == "running"  # nothing could mark it: SIGKILL
    assert job.record()["driver"]["pid"] == job.process.pid
    listing = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "runs", str(tmp_path / "results"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(listing.stdout)["status"] == "lost"
    table = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "runs", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "preemptible  lost" in table


@pytest.mark.timeout(120)
def test_sighup_ends_the_run_with_a_final_status(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "5")
    job.wait_for_reports(1)
    job.process.send_signal(signal.SIGHUP)
    code, results = job.finish()
    assert code != 0 and "SIGHUP" in job.stderr
    assert job.record()["status"] == "interrupted"
    assert_nothing_left()


@pytest.mark.timeout(150)
def test_sighup_to_torchrun_ends_the_run_interrupted_and_every_ranks_fit_raises(tmp_path: Path) -> None:
    job = Job(tmp_path, "--num-workers", "2", torchrun=True, script=HANGUP_JOB)
    job.wait_for_reports(2)
    job.process.send_signal(signal.SIGHUP)  # torchrun's agent passes it on to both ranks
    sent_at = time.monotonic()
    code, results = job.finish(timeout=60)
    assert time.monotonic() - sent_at < 20, "the ranks should end at once, not when torchrun gives up on them (30 s)"
    assert code != 0
    assert sorted(results) == ["0", "1"], job.stdout + job.stderr
    for rank in ("0", "1"):
        assert results[rank]["error"] == "HangUp" and "SIGHUP" in results[rank]["message"], results[rank]
    record = job.record()
    assert record["status"] == "interrupted" and record["executor"] == "external", record
    assert "SIGHUP" in record["error"]["message"]
    assert_nothing_left()


@pytest.mark.timeout(120)
def test_sighup_in_local_mode_ends_the_run_interrupted(tmp_path: Path) -> None:
    job = Job(tmp_path, "--num-workers", "0", script=HANGUP_JOB)
    job.wait_for_reports(2)
    job.process.send_signal(signal.SIGHUP)
    code, results = job.finish()
    assert code == 1 and results["driver"]["error"] == "HangUp", job.stdout + job.stderr
    assert "SIGHUP" in results["driver"]["message"]
    record = job.record()
    assert record["status"] == "interrupted" and record["executor"] == "local_mode", record
    assert "SIGHUP" in record["error"]["message"]
    assert_nothing_left()


@pytest.mark.timeout(120)
def test_an_exception_in_a_callback_ends_the_run_with_a_final_status(tmp_path: Path) -> None:
    job = Job(tmp_path, "--every", "5", "--callback-fails")
    code, results = job.finish(timeout=90)
    assert code != 0 and "the callback exits on purpose" in job.stderr
    record = job.record()
    assert record["status"] == "failed" and "SystemExit: the callback exits on purpose" in record["error"]["message"]
    assert_nothing_left()


def test_a_drain_deadline_sooner_than_the_grace_shortens_it_and_the_error_names_the_cause() -> None:
    from lockstep._internal.run.preemption import Preemption

    soon = Preemption(grace_s=25.0)
    soon.notice("10.0.0.2", [1], cause="a Ray node drain", deadline_ms=int((time.time() + 5) * 1000))
    left = soon.time_left()
    assert left is not None and 3.0 < left <= 5.0, "Ray's deadline, 5 s away, comes before the 25 s grace"
    assert "a Ray node drain for rank(s) [1] on 10.0.0.2" in str(soon.error(None))
    late = Preemption(grace_s=25.0)
    late.notice("10.0.0.2", [1], cause="a Ray node drain", deadline_ms=int((time.time() + 600) * 1000))
    assert 20.0 < (late.time_left() or 0.0) <= 25.0, "a later deadline leaves the grace as it is"
    signal_notice = Preemption(grace_s=25.0)
    signal_notice.notice("host", [0])
    assert "SIGTERM for rank(s) [0]" in str(signal_notice.error(None))
