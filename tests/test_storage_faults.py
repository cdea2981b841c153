"""Storage that misbehaves (issue #24, points 1 and 2): outages ridden out and full disks named.

The S3 test server sits behind a fault-injecting proxy on loopback (tests/fault_proxy.py); the
full disk is a small tmpfs mounted for the test (tests/storage_faults.py).
"""

from __future__ import annotations

import json
import logging
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_proxy import FaultProxy
from s3_server import s3_environment, s3_server
from storage_faults import closed_port, mount_unavailable_reason, resize, small_filesystem

import lockstep
from lockstep import Checkpoint, FailureConfig, Result, RunConfig, ScalingConfig, StorageFullError, TrainingFailedError
from lockstep._internal.persist.fault_kinds import FaultKind, classify
from lockstep._internal.persist.outages import add_outage, outages_line
from lockstep._internal.persist.report_log import AppendingReportLog
from lockstep._internal.persist.retry import Outage, StorageRetry
from lockstep._internal.persist.retry_counts import retry_counts
from lockstep.errors import StorageUnreachableError
from lockstep.torch import TorchTrainer

RETRY_LOGGER = "lockstep._internal.persist.retry"


@pytest.fixture(scope="module")
def proxied_s3() -> Iterator[FaultProxy]:
    """The S3 test server behind the proxy, the AWS_* variables pointing at the proxy, and the
    bucket "runs" made."""
    with (
        s3_server() as env,
        FaultProxy(int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])) as proxy,
        s3_environment({**env, "AWS_ENDPOINT_URL": proxy.url}),
    ):
        yield proxy


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 5 MiB tmpfs, unmounted after the test."""
    reason = mount_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with small_filesystem(tmp_path / "disk", "5m") as disk:
        yield disk


# -- what errors mean -----------------------------------------------------------------------------


def one_try_s3fs(endpoint: str):  # noqa: ANN201 - s3fs is untyped
    """An s3fs filesystem that tries each request once, so the client's own error comes out."""
    import s3fs

    filesystem = s3fs.S3FileSystem(
        skip_instance_cache=True,
        endpoint_url=endpoint,
        config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 5},
    )
    filesystem.retries = 1
    return filesystem


def one_try_pyarrow(endpoint: str):  # noqa: ANN201 - pyarrow.fs is untyped
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(
        endpoint_override=endpoint,
        scheme="http",
        access_key="lockstep-test",
        secret_key="lockstep-test",
        region="us-east-1",
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )


def raised(action) -> BaseException:  # noqa: ANN001
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the test looks at what it was
        return error
    raise AssertionError("the operation succeeded where it had to fail")


def pyarrow_put(filesystem, path: str) -> None:  # noqa: ANN001
    with filesystem.open_output_stream(path) as stream:
        stream.write(b"x")


@pytest.mark.timeout(120)
def test_errors_of_real_clients_are_classified(proxied_s3: FaultProxy, small_disk: Path) -> None:
    from botocore.exceptions import ClientError

    refused = f"http://127.0.0.1:{closed_port()}"
    transient = {
        "s3fs, refused": raised(lambda: one_try_s3fs(refused).pipe_file("runs/a", b"x")),
        "pyarrow, refused": raised(lambda: pyarrow_put(one_try_pyarrow(refused), "runs/a")),
        # what getaddrinfo raises while the resolver is unreachable (looked up for real, a name
        # would depend on this machine's DNS)
        "DNS blip": socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        "socket, refused": raised(lambda: socket.create_connection(("127.0.0.1", closed_port()))),
    }
    proxied_s3.reset_every = 1
    try:
        transient["s3fs, reset"] = raised(lambda: one_try_s3fs(proxied_s3.url).pipe_file("runs/a", b"x"))
        transient["pyarrow, reset"] = raised(lambda: pyarrow_put(one_try_pyarrow(proxied_s3.url), "runs/a"))
    finally:
        proxied_s3.reset_every = 0
    proxied_s3.slow_down = True
    try:
        transient["s3fs, SlowDown"] = raised(lambda: one_try_s3fs(proxied_s3.url).pipe_file("runs/a", b"x"))
        transient["pyarrow, SlowDown"] = raised(lambda: pyarrow_put(one_try_pyarrow(proxied_s3.url), "runs/a"))
    finally:
        proxied_s3.slow_down = False
    answer = {
        "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
        "ResponseMetadata": {"HTTPStatusCode": 403},
    }
    permanent = {
        "s3fs, no such bucket": raised(lambda: one_try_s3fs(proxied_s3.url).pipe_file("no-such-bucket/a", b"x")),
        "pyarrow, no such bucket": raised(lambda: pyarrow_put(one_try_pyarrow(proxied_s3.url), "no-such-bucket/a")),
        "s3fs, not found": raised(lambda: one_try_s3fs(proxied_s3.url).cat_file("runs/missing")),
        "botocore, access denied": ClientError(answer, "PutObject"),
        "local, not found": raised(lambda: open(small_disk / "missing", "rb")),  # noqa: SIM115
    }
    full = {"local, no space": raised(lambda: (small_disk / "big").write_bytes(b"\0" * 6 * 2**20))}
    for name, error in transient.items():
        assert classify(error) is FaultKind.TRANSIENT, f"{name}: {type(error).__name__}: {error}"
    for name, error in permanent.items():
        assert classify(error) is FaultKind.PERMANENT, f"{name}: {type(error).__name__}: {error}"
    assert classify(full["local, no space"]) is FaultKind.FULL


# -- the retry bound ------------------------------------------------------------------------------


def refused_connection() -> None:
    socket.create_connection(("127.0.0.1", closed_port()), timeout=5).close()


def test_a_permanent_error_fails_at_once(tmp_path: Path) -> None:
    calls = []

    def read_missing() -> bytes:
        calls.append(time.monotonic())
        return (tmp_path / "missing").read_bytes()

    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        StorageRetry(limit_s=60).call("read_record", str(tmp_path / "missing"), read_missing)
    assert len(calls) == 1 and time.monotonic() - started < 1


def test_an_outage_past_the_bound_says_how_long_where_and_how_to_wait_longer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = retry_counts().get("write_record", 0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=RETRY_LOGGER), pytest.raises(StorageUnreachableError) as raised:
        StorageRetry(limit_s=2).call("write_record", "s3://runs/x/lockstep_run.json", refused_connection)
    took = time.monotonic() - started
    assert 2 <= took < 4, f"gave up after {took:.1f} s, with a 2 s bound"
    message = str(raised.value)
    assert "storage was unreachable for 2 s" in message
    assert "writing the run record at s3://runs/x/lockstep_run.json" in message
    assert "ConnectionRefusedError" in message
    assert "RunConfig(storage_retry_s=2); raise it" in message
    assert retry_counts()["write_record"] > before
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("Storage unreachable") and "giving up" in lines[1]


def test_an_outage_ridden_out_is_logged_once_counted_and_told(caplog: pytest.LogCaptureFixture) -> None:
    outages: list[Outage] = []
    attempts: list[int] = []

    def flaky() -> str:  # refused three times, then answered
        attempts.append(1)
        if len(attempts) <= 3:
            refused_connection()
        return "written"

    before = retry_counts().get("write_reports", 0)
    retry = StorageRetry(limit_s=30, on_outage_end=outages.append)
    with caplog.at_level(logging.WARNING, logger=RETRY_LOGGER):
        assert retry.call("write_reports", "/runs/x/reports.jsonl", flaky) == "written"
        assert retry.call("write_reports", "/runs/x/reports.jsonl", lambda: "at once") == "at once"
    assert retry_counts()["write_reports"] == before + 3
    assert len(outages) == 1 and outages[0].retries == 3 and 0 < outages[0].lasted_s < 5
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("Storage unreachable: writing the report history at /runs/x/reports.jsonl failed")
    assert lines[1].startswith("Storage reachable again after") and "(3 retries)" in lines[1]


def test_a_full_disk_is_never_retried_and_a_report_is_never_written_twice(small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (5 * 2**20 - 8192))
    log = AppendingReportLog(str(small_disk / "reports.jsonl"), StorageRetry(limit_s=60))
    log.append(json.dumps({"report_index": 0}))
    started = time.monotonic()
    with pytest.raises(StorageFullError) as raised:
        log.append(json.dumps({"report_index": 1, "metrics": "x" * 20000}))
    assert time.monotonic() - started < 1, "ENOSPC must not be retried"
    assert "the storage is full: writing the report history at" in str(raised.value)
    assert "what was being written needs 19.6 KiB" in str(raised.value)
    assert (small_disk / "reports.jsonl").read_text() == '{"report_index": 0}\n', "no torn line may stay"
    filler.unlink()
    log.append(json.dumps({"report_index": 1}))
    log.close()
    lines = (small_disk / "reports.jsonl").read_text().splitlines()
    assert [json.loads(line)["report_index"] for line in lines] == [0, 1]


def test_outages_seen_by_several_processes_are_one_in_the_record() -> None:
    kept = add_outage(None, Outage(1000.0, 15.0, 4), "rank 1")
    kept = add_outage(kept, Outage(1002.0, 14.5, 3), "driver")
    kept = add_outage(kept, Outage(999.5, 15.0, 5), "rank 0")
    assert kept["count"] == 1 and kept["retries"] == 12 and kept["lost_s"] == pytest.approx(17.0)
    assert kept["recent"][0]["seen_by"] == ["driver", "rank 0", "rank 1"]
    kept = add_outage(kept, Outage(2000.0, 2.0, 1), "rank 1")
    assert kept["count"] == 2 and kept["lost_s"] == pytest.approx(19.0)
    assert outages_line({"storage_outages": kept}) == "2 outages ridden out, 19.0 s lost (13 retries)"
    assert outages_line({}) is None


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), True, "300"])
def test_storage_retry_s_is_checked_before_anything_starts(value: object) -> None:
    with pytest.raises(ValueError, match="RunConfig.storage_retry_s must be a number of seconds >= 0"):
        RunConfig(storage_retry_s=value)  # type: ignore[arg-type]


# -- a run through an outage ----------------------------------------------------------------------


def payload(step: int, rank: int, size: int = 100_000) -> bytes:
    """What rank ``rank`` saves at ``step``: bytes that say which checkpoint they belong to."""
    return random.Random(step * 100 + rank).randbytes(size)


def train_through_an_outage(config: dict) -> None:
    """Checkpoints every step, SYNC and ASYNC; rank 0 asks the proxy for an outage at one step."""
    rank = lockstep.get_context().get_world_rank()
    for step in range(config["steps"]):
        if step == config["outage_at"] and rank == 0:
            with socket.create_connection(("127.0.0.1", config["control_port"])) as control:
                control.sendall(f"outage {config['outage_s']} 5\n".encode())
                assert control.makefile().readline().strip() == "ok"
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, f"rank{rank}.bin").write_bytes(payload(step, rank))
            mode = "ASYNC" if step in config["async_steps"] else "SYNC"
            lockstep.report(
                {"step": step, "at": time.time()},
                checkpoint=Checkpoint.from_directory(folder),
                checkpoint_upload_mode=mode,
            )


def whole(checkpoint: Checkpoint, step: int) -> bool:
    with checkpoint.as_directory() as folder:
        return all(Path(folder, f"rank{rank}.bin").read_bytes() == payload(step, rank) for rank in (0, 1))


@pytest.mark.timeout(150)
def test_a_two_worker_run_rides_out_an_outage_and_resets(
    proxied_s3: FaultProxy, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "steps": 8,
        "outage_at": 1,
        "outage_s": 15,
        "async_steps": [1, 2, 3, 6],
        "control_port": proxied_s3.control_port,
    }
    before = retry_counts()
    # ranks retrying for 15 s are making progress: a 6 s hang threshold must not fire
    hang_after_6_s = FailureConfig(hang_timeout_s=6, hang_first_step_timeout_s=6)
    with caplog.at_level(logging.WARNING, logger=RETRY_LOGGER):
        result = TorchTrainer(
            train_through_an_outage,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="outage", storage_path="s3://runs/faults", failure_config=hang_after_6_s),
        ).fit()
    ((outage_start, outage_end),) = proxied_s3.outages
    assert outage_end is not None and proxied_s3.resets > 0, "the outage and the resets happened"
    history = result.metrics_dataframe
    assert list(history["report_index"]) == list(range(8)), "every report recorded once"
    assert history["at"][3] < outage_end, "ASYNC uploads that retry don't hold training up"
    recorded = Result.from_path("s3://runs/faults/outage")
    assert [metrics["step"] for _, metrics in recorded.best_checkpoints] == list(range(8))
    for checkpoint, metrics in recorded.best_checkpoints:
        assert whole(checkpoint, metrics["step"]), f"{checkpoint} is not whole"

    driver_lines = [record.getMessage() for record in caplog.records]
    assert sum(line.startswith("Storage unreachable") for line in driver_lines) == 1, driver_lines
    assert sum(line.startswith("Storage reachable again") for line in driver_lines) == 1, driver_lines
    counted = {name: count - before.get(name, 0) for name, count in retry_counts().items()}
    assert counted.get("write_reports", 0) > 0, counted
    record = json.loads(result.filesystem.cat_file("runs/faults/outage/lockstep_run.json"))
    outages = record["storage_outages"]
    assert outages["count"] == 1 and outages["retries"] > 0, outages
    assert outages["recent"][0]["seen_by"] == ["driver", "rank 0", "rank 1"], outages
    assert outage_end - outage_start - 5 < outages["lost_s"] < outage_end - outage_start + 15, outages
    for rank in (0, 1):
        log = result.filesystem.cat_file(f"runs/faults/outage/logs/rank_{rank}.log").decode()
        assert log.count("Storage unreachable") == 1 and log.count("Storage reachable again") == 1, log

    from lockstep.cli import main

    main(["show", "s3://runs/faults/outage"])
    assert "storage:      1 outage ridden out" in capsys.readouterr().out


# -- a full disk ----------------------------------------------------------------------------------


def fill_the_disk(config: dict) -> None:
    """Checkpoints of 1 MiB per rank, from where the run's latest checkpoint left off."""
    rank = lockstep.get_context().get_world_rank()
    first = 0
    if (start := lockstep.get_checkpoint()) is not None:
        with start.as_directory() as folder:
            first = int(Path(folder, "step.txt").read_text()) + 1
    for step in range(first, first + config["steps"]):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            Path(folder, f"rank{rank}.bin").write_bytes(payload(step, rank, 2**20))
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder))


@pytest.mark.timeout(150)
def test_a_full_disk_ends_the_run_naming_it_and_a_rerun_continues(small_disk: Path) -> None:
    run_config = RunConfig(name="full", storage_path=str(small_disk))
    trainer = TorchTrainer(
        fill_the_disk,
        train_loop_config={"steps": 4},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config,
    )
    with pytest.raises(TrainingFailedError) as raised:
        trainer.fit()
    message = str(raised.value)
    assert "StorageFullError" in message and "the storage is full: writing checkpoint files at" in message, message
    assert str(small_disk / "full" / "checkpoint_000002") in message, message
    assert "what was being written needs 1.0 MiB" in message, message
    run = small_disk / "full"
    recorded = Result.from_path(run)
    assert recorded.checkpoint is not None and recorded.checkpoint.path == str(run / "checkpoint_000001")
    assert Path(recorded.checkpoint.path, "rank1.bin").read_bytes() == payload(1, 1, 2**20)
    assert sorted(path.name for path in run.glob("checkpoint_*")) == ["checkpoint_000000", "checkpoint_000001"]
    assert not list(run.glob("*.tmp")), "no half-written record stays"

    resize(small_disk, "16m")
    resumed = TorchTrainer(
        fill_the_disk,
        train_loop_config={"steps": 2},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config,
    ).fit()
    assert list(resumed.metrics_dataframe["step"]) == [0, 1, 2, 3], "continued from checkpoint_000001"
    assert list(resumed.metrics_dataframe["report_index"]) == [0, 1, 2, 3]
    with resumed.checkpoint.as_directory() as folder:
        assert Path(folder, "rank0.bin").read_bytes() == payload(3, 0, 2**20)


def resume_through_an_outage(config: dict) -> None:
    """Save one checkpoint; run again, each rank reads it back while storage is down."""
    rank = lockstep.get_context().get_world_rank()
    start = lockstep.get_checkpoint()
    if start is None:
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, f"rank{rank}.bin").write_bytes(payload(0, rank))
            lockstep.report({"step": 0}, checkpoint=Checkpoint.from_directory(folder))
        return
    if rank == 0:
        with socket.create_connection(("127.0.0.1", config["control_port"])) as control:
            control.sendall(f"outage {config['outage_s']} 0\n".encode())
            assert control.makefile().readline().strip() == "ok"
    from lockstep.collective import barrier

    barrier()  # both ranks read while storage is down
    lockstep.report({"step": 1, "resumed_whole": whole(start, 0)})


@pytest.mark.timeout(120)
def test_a_resumed_run_reads_its_checkpoint_through_an_outage_without_being_named_hung(
    proxied_s3: FaultProxy,
) -> None:
    # longer than botocore's own retries can span (4 waits, under 1 + 2 + 4 + 8 s): lockstep's own retry rides it out
    config = {"control_port": proxied_s3.control_port, "outage_s": 15}
    run_config = RunConfig(
        name="resume",
        storage_path="s3://runs/faults",
        failure_config=FailureConfig(hang_timeout_s=4, hang_first_step_timeout_s=4),
    )
    for _ in range(2):
        result = TorchTrainer(
            resume_through_an_outage,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=run_config,
        ).fit()
    assert result.metrics == {"step": 1, "resumed_whole": True}
    record = json.loads(result.filesystem.cat_file("runs/faults/resume/lockstep_run.json"))
    outages = record["storage_outages"]
    assert outages["count"] == 1 and outages["recent"][0]["seen_by"] == ["rank 0", "rank 1"], outages
