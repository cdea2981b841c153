"""`lockstep dashboard` over HTTP (its JSON API, the token, read-only), over local storage and a
live run on an S3 server whose logs reach storage while it runs; the run record's heartbeat and
the `lost` status it allows. The pages in a real browser: tests/test_dashboard_browser.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from dashboard_runs import open_gate, start_dashboard, start_gated_run, stop, stop_gated_run, wait_for, write_long_run

from lockstep._internal.persist.run_status import shown_status
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.run import run_record
from lockstep._internal.run.run_record import RunRecorder
from lockstep.config import CheckpointConfig


def get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def get_json(url: str) -> Any:
    status, _, body = get(url)
    assert status == 200, body
    return json.loads(body)


# -- the record's heartbeat and the lost status ---------------------------------------------------------


def test_the_record_beats_only_when_nothing_else_wrote_it_for_an_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = RunRecorder(RunStorage(str(tmp_path / "run")), CheckpointConfig(), world_size=1)
    recorder.open()
    first = recorder.storage.read_record()
    assert first is not None and first["heartbeat_interval_s"] == run_record.HEARTBEAT_INTERVAL_S
    recorder.beat()
    assert recorder.storage.read_record()["heartbeat_at"] == first["heartbeat_at"], "a beat right after a write"
    monkeypatch.setattr(run_record, "HEARTBEAT_INTERVAL_S", 0.0)
    recorder.note_rank(0, "trainer-0", 4321)
    recorder.beat()
    beaten = recorder.storage.read_record()
    assert beaten["heartbeat_at"] > first["heartbeat_at"] and beaten["ranks"] == {
        "0": {"host": "trainer-0", "pid": 4321}
    }
    recorder.finish("finished")
    finished = recorder.storage.read_record()
    recorder.beat()
    assert recorder.storage.read_record() == finished, "a finished run's record no longer beats"


def test_a_running_run_whose_heartbeat_stopped_is_lost() -> None:
    elsewhere = {"status": "running", "driver": {"host": "another-host", "pid": 1}, "heartbeat_interval_s": 30.0}
    now = time.time()
    assert shown_status({**elsewhere, "heartbeat_at": now - 60}, now) == "running"
    assert shown_status({**elsewhere, "heartbeat_at": now - 200}, now) == "lost"
    assert shown_status({**elsewhere, "status": "finished", "heartbeat_at": now - 10_000}, now) == "finished"
    assert shown_status({"status": "running", "driver": {"host": "another-host", "pid": 1}}, now) == "running"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = {"status": "running", "driver": {"host": socket.gethostname(), "pid": int(gone.stdout)}}
    assert shown_status({**here, "heartbeat_at": now, "heartbeat_interval_s": 30.0}, now) == "lost"


# -- the API over local storage --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_site(tmp_path_factory: pytest.TempPathFactory) -> Any:
    storage = str(tmp_path_factory.mktemp("dashboard") / "results")
    write_long_run(storage, "long", reports=3000)
    Path(storage, "not-a-run").mkdir()
    yield storage


def test_the_api_lists_runs_and_serves_a_runs_details_reports_and_logs(local_site: str) -> None:
    process, url = start_dashboard(local_site)
    try:
        assert url.startswith("http://127.0.0.1:"), "not bound to loopback by default"
        listing = get_json(url + "api/runs")
        assert [run["name"] for run in listing["runs"]] == ["long"], "a folder without a record is no run"
        run = listing["runs"][0]
        assert run["status"] == "finished" and run["reports"] == 3000 and run["progress"] == 1.0
        assert run["metrics"]["loss"]["min"] < run["metrics"]["loss"]["last"] < run["metrics"]["loss"]["max"]

        detail = get_json(url + "api/runs/long")
        assert detail["slow_rank"] == {"rank": 1, "cause": "data", "share": pytest.approx(0.5)}
        assert [(rank["rank"], rank["host"], rank["slow"]) for rank in detail["ranks"]] == [
            (0, "trainer-0", False),
            (1, "trainer-1", True),
        ]
        kept = [checkpoint for checkpoint in detail["checkpoints"] if checkpoint["kept"]]
        assert [checkpoint["dir_name"] for checkpoint in kept] == ["checkpoint_001999", "checkpoint_002999"]
        assert all(checkpoint["size_bytes"] == 4096 for checkpoint in kept)
        assert [checkpoint["kept"] for checkpoint in detail["checkpoints"]] == [False, True, True]
        assert detail["config"]["train_loop_config"] == {"lr": 0.05, "steps": 3000}

        tail = get_json(url + "api/runs/long/reports?since=2990")
        assert tail["start"] == 2990 and tail["count"] == 3000 and tail["index"] == list(range(2990, 3000))
        assert set(tail["metrics"]) == {"step", "loss", "accuracy", "lr"} and len(tail["metrics"]["loss"]) == 10

        status, headers, _ = get(url)
        assert status == 200 and "default-src 'self'" in headers["content-security-policy"]
        status, _, body = get(url + "static/chart.js")
        assert status == 200 and b"class LineChart" in body
        assert get(url + "api/runs/missing")[0] == 404
        assert get(url + "api/runs/..%2F..%2Fetc")[0] == 404
        posted = urllib.request.Request(url + "api/runs", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(posted, timeout=20)
        assert refused.value.code == 405, "the dashboard is read-only"
    finally:
        stop(process)


def test_off_loopback_the_dashboard_wants_its_token(local_site: str) -> None:
    process, url = start_dashboard(local_site, "--host", "0.0.0.0")
    try:
        assert "?token=" in url, "listening on every address without a token"
        token = url.split("?token=", 1)[1]
        port = url.split(":")[2].split("/")[0]
        base = f"http://127.0.0.1:{port}/"
        status, _, body = get(base + "api/runs")
        assert status == 401 and b"needs its token" in body
        assert get(base + "api/runs", Authorization="Bearer wrong")[0] == 401
        assert get(base + "api/runs", Authorization=f"Bearer {token}")[0] == 200
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        with opener.open(f"{base}runs/long?token={token}", timeout=20) as page:
            assert page.url == f"{base}runs/long" and b"run.js" in page.read(), "the token is dropped from the URL"
        with opener.open(base + "api/runs", timeout=20) as listing:
            assert json.loads(listing.read())["runs"][0]["name"] == "long", "the cookie carries the token"
    finally:
        stop(process)


def test_the_help_says_how_to_reach_it_through_an_ssh_tunnel() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "dashboard", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "ssh -N -L 8267:127.0.0.1:8267 you@training-machine" in shown and "http://localhost:8267/" in shown


# -- a live run on an S3 server ------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_live_run_on_s3_shows_its_reports_and_its_log_tail_while_it_runs(
    s3_env: dict[str, str], tmp_path: Path
) -> None:
    gates = tmp_path / "gates"
    driver = start_gated_run("s3://runs/live", "on-s3", gates)
    dashboard = None
    try:
        import s3fs

        store = s3fs.S3FileSystem(skip_instance_cache=True)
        wait_for(lambda: store.exists("runs/live/on-s3/lockstep_run.json"), 90, "the run record on S3", interval_s=0.5)
        dashboard, url = start_dashboard("s3://runs/live")
        open_gate(gates, "0")
        run = wait_for(
            lambda: next((row for row in get_json(url + "api/runs")["runs"] if row["reports"] == 1), None),
            60,
            "the first report through the dashboard",
            interval_s=0.5,
        )
        assert run["status"] == "running"
        logs = wait_for(
            lambda: get_json(url + "api/runs/on-s3/logs")["logs"].get("rank_0.log"),
            60,
            "rank 0's log on S3 while the run goes on",
            interval_s=0.5,
        )
        assert "rank 0 makes report 0" in logs
        assert get_json(url + "api/runs/on-s3")["ranks"][0]["status"] == "running"
        assert driver.poll() is None, "the run ended before the checks"
        stop_gated_run(driver, gates)
        assert driver.returncode == 0
        assert wait_for(lambda: get_json(url + "api/runs/on-s3")["status"] == "finished", 30, "finished")
    finally:
        if dashboard is not None:
            stop(dashboard)
        if driver.poll() is None:
            stop(driver)
