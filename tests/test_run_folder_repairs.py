"""The run folder survives what crashes and outages leave in it: a torn last line of the report
history, a history that can't be written, a checkpoint download that fails verification, names
that would collide with the run's own entries, and checkpoint folders no record names."""

from __future__ import annotations

import glob
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from lockstep import Checkpoint, CheckpointCorruptedError, RunConfig
from lockstep._internal.persist.manifest import read_manifest, write_manifest
from lockstep._internal.persist.report_log import RewritingReportLog
from lockstep._internal.persist.retry import StorageRetry
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.rank.worker_session import _checked_dir_name
from lockstep.errors import StorageUnreachableError
from lockstep.torch import TorchTrainer

pytestmark = pytest.mark.timeout(60)


def report_line(index: int) -> str:
    return json.dumps({"report_index": index, "timestamp": index, "metrics": {"x": index}, "checkpoint_dir_name": None})


def test_a_rerun_cuts_the_torn_last_line_a_crash_left_in_the_history(tmp_path: Path) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    storage.write_record({"status": "running", "checkpoints": []})
    history = Path(storage.path_of("reports.jsonl"))
    history.write_text(report_line(0) + "\n" + report_line(1)[:25])  # the second append cut short
    assert [row["report_index"] for row in storage.read_reports()] == [0]

    log = storage.open_report_log([report_line(0)])
    log.append(report_line(1))
    log.close()
    assert history.read_text() == report_line(0) + "\n" + report_line(1) + "\n"
    assert [row["report_index"] for row in storage.read_reports()] == [0, 1]


class FailingWrites(MemoryFileSystem):
    """A memory filesystem whose writes fail with a connection reset while ``failing``."""

    failing = True

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        if self.failing:
            raise ConnectionResetError(104, "Connection reset by peer (the test's outage)")
        super().pipe_file(path, value, *args, **kwargs)


def test_a_history_that_cannot_be_written_fails_flush_and_close() -> None:
    filesystem = FailingWrites()
    path = f"/history-{os.getpid()}-lost/reports.jsonl"
    log = RewritingReportLog(filesystem, path, [], StorageRetry(limit_s=0.3))
    log.append(report_line(0))
    with pytest.raises(StorageUnreachableError, match="writing the report history"):
        log.flush()  # a commit must not name a checkpoint whose report is not in storage
    with pytest.raises(StorageUnreachableError, match="writing the report history"):
        log.close()  # nor may the run end as if its history were kept
    assert not filesystem.exists(path)


def test_a_history_write_that_failed_is_made_good_by_the_next_line() -> None:
    filesystem = FailingWrites()
    path = f"/history-{os.getpid()}-healed/reports.jsonl"
    log = RewritingReportLog(filesystem, path, [], StorageRetry(limit_s=0.3))
    log.append(report_line(0))
    with pytest.raises(StorageUnreachableError):
        log.flush()
    filesystem.failing = False
    log.append(report_line(1))
    log.flush()
    log.close()
    assert filesystem.cat_file(path).decode() == report_line(0) + "\n" + report_line(1) + "\n"


def checkpoint_downloads() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "lockstep_checkpoint_*")))


def test_a_download_that_fails_verification_leaves_no_folder() -> None:
    filesystem = fsspec.filesystem("memory")
    folder = f"/bucket-{os.getpid()}/run/checkpoint_000001"
    filesystem.pipe_file(f"{folder}/model.pt", b"x" * 1000)
    write_manifest(filesystem, folder, {0: [("model.pt", 1000, 12345)]})  # not the file's checksum
    before = checkpoint_downloads()
    with pytest.raises(CheckpointCorruptedError, match="checksum differs"):
        Checkpoint(f"memory://{folder}").to_directory()
    with pytest.raises(CheckpointCorruptedError), Checkpoint(f"memory://{folder}").as_directory():
        pass
    assert checkpoint_downloads() == before


class FailingOnce(MemoryFileSystem):
    """A memory filesystem whose first read fails with a connection reset."""

    reads = 0

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        type(self).reads += 1
        if type(self).reads == 1:
            raise ConnectionResetError(104, "Connection reset by peer (the test's outage)")
        return super().cat_file(path, *args, **kwargs)


def test_a_manifest_read_rides_out_a_reset_connection() -> None:
    filesystem = FailingOnce()
    folder = f"/bucket-{os.getpid()}/run/checkpoint_000002"
    write_manifest(filesystem, folder, {0: [("model.pt", 10, 1)]})
    manifest = read_manifest(filesystem, folder)
    assert manifest is not None and "model.pt" in manifest["files"] and FailingOnce.reads == 2


def test_a_checkpoint_cannot_be_named_like_the_logs_folder() -> None:
    with pytest.raises(ValueError, match="must be a plain folder name"):
        _checked_dir_name("logs", 3)


def never_runs() -> None:
    raise AssertionError("no worker may start")


def test_checkpoint_folders_without_a_record_refuse_the_run_and_stay(tmp_path: Path) -> None:
    stray = tmp_path / "old-run" / "checkpoint_000000"
    stray.mkdir(parents=True)
    (stray / "model.pt").write_bytes(b"weights")
    trainer = TorchTrainer(never_runs, run_config=RunConfig(name="old-run", storage_path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"holds checkpoint folders \(checkpoint_000000\) but no run record"):
        trainer.fit()
    assert (stray / "model.pt").read_bytes() == b"weights"
    assert not (tmp_path / "old-run" / "lockstep_run.json").exists()
