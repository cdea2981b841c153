"""Crash safety shown: the driver killed (SIGKILL) in the middle of writing the run record, on
local disk and on an S3 server, leaves the previous checkpoint the latest and the same command
resumes from it; a DataLoader's worker processes are gone after the run ends, fails or is
interrupted. (The driver's memory over 1,000 reports: tests/test_trainer.py's soak test.)"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, running_after, sigint_raises, tagged_processes_after

from lockstep._internal.persist.storage import CRASH_TEST_GATE

SCRIPTS = Path(__file__).parent / "scripts"
CHECKPOINT_EVERY_STEP = str(SCRIPTS / "checkpoint_every_step.py")
STEPS = 4
# Record writes of a fresh run: 1 = it starts, 2 = checkpoint_000000 committed, 3 = checkpoint_000001.
WRITE_OF_THE_SECOND_CHECKPOINT = 3


def start_driver(args: list[str], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        env={**os.environ, **env},
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_raises,
    )


def run_to_the_end(args: list[str], **env: str) -> dict[str, Any]:
    driver = start_driver(args, **env)
    stdout, stderr = driver.communicate(timeout=100)
    assert driver.returncode == 0, f"exit {driver.returncode}\n{stdout}\n{stderr}"
    return json.loads(stdout.split("RESULT ", 1)[1])


def kill_and_wait_for_its_workers(driver: subprocess.Popen[str]) -> None:
    driver.send_signal(signal.SIGKILL)
    driver.communicate(timeout=30)
    assert tagged_processes_after(time.monotonic() + 10) == [], "workers outlived their killed driver"


def wait_until_stopped_at_the_gate(gate: Path, driver: subprocess.Popen[str]) -> int:
    """Open the writing end of the fifo once the driver has opened its reading end: it is then
    blocked in the middle of the record write, until this end is closed."""
    deadline = time.monotonic() + 90
    while True:
        try:
            return os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:
            if error.errno != errno.ENXIO:
                raise
        assert driver.poll() is None, f"the driver ended before the gate: {driver.communicate()}"
        assert time.monotonic() < deadline, "the driver never reached the record write"
        time.sleep(0.02)


@pytest.mark.timeout(180)
def test_driver_killed_while_writing_the_record_on_local_disk(tmp_path: Path) -> None:
    results, gate = tmp_path / "results", tmp_path / "gate"
    os.mkfifo(gate)
    args = [CHECKPOINT_EVERY_STEP, str(results), "crash", str(STEPS)]
    driver = start_driver(args, **{CRASH_TEST_GATE: f"{WRITE_OF_THE_SECOND_CHECKPOINT}:{gate}"})
    gate_end = wait_until_stopped_at_the_gate(gate, driver)
    try:
        kill_and_wait_for_its_workers(driver)
    finally:
        os.close(gate_end)

    run = results / "crash"
    torn = list(run.glob("lockstep_run.json.*.tmp"))
    assert len(torn) == 1, "the driver was not killed in the middle of a record write"
    with pytest.raises(json.JSONDecodeError):
        json.loads(torn[0].read_text())  # half a record: the kill did cut the write
    record = json.loads((run / "lockstep_run.json").read_text())
    assert record["status"] == "running" and record["latest_checkpoint"] == "checkpoint_000000"
    assert (run / "checkpoint_000001").is_dir(), "the checkpoint being committed was fully written"

    resumed = run_to_the_end(args)
    assert resumed["metrics"] == {"step": STEPS - 1, "start": 1}, "the rerun did not continue from checkpoint_000000"
    record = json.loads((run / "lockstep_run.json").read_text())
    assert record["status"] == "finished" and resumed["checkpoint"] == str(run / record["latest_checkpoint"])


class CuttingProxy:
    """A TCP proxy in front of the S3 server that passes everything through, except the
    ``cut_at``-th PUT of a run record: of that request only the headers and half the body go
    on (then :attr:`cut` is set, and nothing more of that connection)."""

    RECORD_PUT = re.compile(rb"PUT [^ ]*/lockstep_run\.json[^ ]* HTTP/1\.1\r\n")

    def __init__(self, upstream: str, cut_at: int) -> None:
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.cut_at = cut_at
        self.record_puts = 0
        self.cut = threading.Event()
        self._lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._to_server, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            target.close()

    def _to_server(self, client: socket.socket, upstream: socket.socket) -> None:
        request: bytes | None = None  # the request being cut, from its first byte
        sent = 0
        tail = b""
        try:
            while data := client.recv(65536):
                if request is None:
                    window = tail + data
                    match = self._cut_here(window, len(tail))
                    if match is None:
                        upstream.sendall(data)
                        tail = window[-512:]
                        continue
                    request, sent = window[match:], len(tail) - match
                else:
                    request += data
                sent = self._send_up_to_the_cut(upstream, request, sent)
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    def _cut_here(self, window: bytes, already_sent: int) -> int | None:
        """Where, in ``window``, the request to cut starts (None: not in this window)."""
        with self._lock:
            for match in self.RECORD_PUT.finditer(window):
                if match.end() > already_sent and not self.cut.is_set():
                    self.record_puts += 1
                    if self.record_puts == self.cut_at:
                        return match.start()
        return None

    def _send_up_to_the_cut(self, upstream: socket.socket, request: bytes, sent: int) -> int:
        head_end = request.find(b"\r\n\r\n")
        if head_end < 0:
            limit = len(request)
        else:
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", request[:head_end])
            limit = head_end + 4 + (int(length.group(1)) // 2 if length else 0)
        if limit > sent:
            upstream.sendall(request[sent:limit])
        if head_end >= 0 and len(request) >= limit:
            self.cut.set()
        return max(sent, min(limit, len(request)))

    def close(self) -> None:
        self.server.close()


@pytest.mark.timeout(180)
def test_driver_killed_while_writing_the_record_on_s3(s3_env: dict[str, str]) -> None:
    import s3fs

    proxy = CuttingProxy(s3_env["AWS_ENDPOINT_URL"], cut_at=WRITE_OF_THE_SECOND_CHECKPOINT)
    try:
        args = [CHECKPOINT_EVERY_STEP, "s3://runs/crash-safety", "crash", str(STEPS)]
        driver = start_driver(args, AWS_ENDPOINT_URL=proxy.url)
        deadline = time.monotonic() + 90
        while not proxy.cut.wait(0.1):
            assert driver.poll() is None, f"the driver ended before the cut: {driver.communicate()}"
            assert time.monotonic() < deadline, "the driver never wrote the record a third time"
        kill_and_wait_for_its_workers(driver)  # its PUT is half sent, and stays so

        store = s3fs.S3FileSystem(skip_instance_cache=True)
        record = json.loads(store.cat_file("runs/crash-safety/crash/lockstep_run.json"))
        assert record["status"] == "running" and record["latest_checkpoint"] == "checkpoint_000000"
        left_logs = logs_left_by(driver.pid)
        killed_runs_log = (left_logs / "logs" / "rank_0.log").read_text()
        assert "step 1 of the run that started at step 0" in killed_runs_log

        resumed = run_to_the_end(args, AWS_ENDPOINT_URL=proxy.url)
    finally:
        proxy.close()
    assert resumed["metrics"] == {"step": STEPS - 1, "start": 1}, "the rerun did not continue from checkpoint_000000"
    record = json.loads(store.cat_file("runs/crash-safety/crash/lockstep_run.json"))
    assert record["status"] == "finished" and resumed["checkpoint"].endswith(record["latest_checkpoint"])
    assert not left_logs.exists(), "the rerun did not take in the logs its killed driver left"
    log = store.cat_file("runs/crash-safety/crash/logs/rank_0.log").decode()
    assert log.startswith(killed_runs_log), "the killed run's last output is missing from the run's log"
    assert f"step {STEPS - 1} of the run that started at step 1" in log[len(killed_runs_log) :]


def logs_left_by(driver_pid: int) -> Path:
    """The local log folder a killed driver of a run on remote storage left behind."""
    for owner in Path(tempfile.gettempdir()).glob("lockstep_logs_*/owner.json"):
        if json.loads(owner.read_text())["pid"] == driver_pid:
            return owner.parent
    raise AssertionError(f"the killed driver {driver_pid} left no local log folder")


LOADER_JOB = str(SCRIPTS / "dataloader_workers_job.py")
GONE_WITHIN_S = 5.0


def assert_gone_soon(pids: list[int], since: float) -> None:
    """Every process in ``pids`` has exited within GONE_WITHIN_S of ``since``."""
    alive = running_after(pids, since + GONE_WITHIN_S - time.monotonic())
    assert not alive, f"DataLoader worker processes {alive} still running {GONE_WITHIN_S} s after the run ended"


def loader_pids(marks: Path) -> list[int]:
    return [int(mark.name) for mark in marks.iterdir()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["finish", "fail"])
def test_dataloader_workers_are_gone_after_the_run_ends_or_fails(tmp_path: Path, mode: str) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    driver = start_driver([LOADER_JOB, str(tmp_path / "results"), str(marks), mode])
    stdout, stderr = driver.communicate(timeout=100)
    ended = time.monotonic()
    if mode == "finish":
        assert driver.returncode == 0 and "FINISHED" in stdout, stderr
    else:
        assert driver.returncode != 0 and "planned failure with the loader's workers running" in stderr
    pids = loader_pids(marks)
    assert len(pids) >= 4, f"expected two loader workers on each of two ranks, saw {pids}"
    assert_gone_soon(pids, ended)


@pytest.mark.timeout(120)
def test_dataloader_workers_are_gone_after_ctrl_c(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    run = tmp_path / "results" / "loader-forever"
    driver = start_driver([LOADER_JOB, str(tmp_path / "results"), str(marks), "forever"])
    deadline = time.monotonic() + 90
    while len(loader_pids(marks)) < 4:
        assert driver.poll() is None and time.monotonic() < deadline, (
            f"the loaders never started: {driver.communicate()}"
        )
        time.sleep(0.05)
    pids = loader_pids(marks)
    driver.send_signal(signal.SIGINT)
    try:
        _, stderr = driver.communicate(timeout=30)
    finally:
        driver.kill()
        driver.wait()
    assert driver.returncode != 0 and "KeyboardInterrupt" in stderr
    assert_gone_soon(pids, time.monotonic())
    assert json.loads((run / "lockstep_run.json").read_text())["status"] == "interrupted"
