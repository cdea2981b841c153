"""Checkpoint, retention and Result, without worker processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lockstep import Checkpoint, CheckpointConfig, Result
from lockstep._internal.checkpoints import checkpoints_to_delete
from lockstep._internal.run_record import RunRecorder
from lockstep._internal.storage import CheckpointEntry, RunStorage


def test_from_directory_refuses_missing_path_and_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Checkpoint.from_directory(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Checkpoint.from_directory(tmp_path / "file")


def test_metadata_round_trip_and_copy(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"weights")
    checkpoint = Checkpoint.from_directory(folder)
    assert checkpoint.get_metadata() == {}
    checkpoint.set_metadata({"epoch": 1})
    checkpoint.update_metadata({"loss": 0.5})
    assert checkpoint.get_metadata() == {"epoch": 1, "loss": 0.5}
    assert json.loads((folder / ".metadata.json").read_text()) == {"epoch": 1, "loss": 0.5}

    copied = checkpoint.to_directory(tmp_path / "copy")
    assert (Path(copied) / "model.pt").read_bytes() == b"weights"
    with checkpoint.as_directory() as local:
        assert local == str(folder)


def _entry(index: int, **metrics: float) -> CheckpointEntry:
    return CheckpointEntry(f"checkpoint_{index:06d}", index, metrics)


def test_retention_keeps_latest_k_without_a_score() -> None:
    entries = [_entry(index) for index in range(5)]
    doomed = checkpoints_to_delete(entries, CheckpointConfig(num_to_keep=2))
    assert [entry.report_index for entry in doomed] == [0, 1, 2]


def test_retention_by_score_never_deletes_the_latest() -> None:
    entries = [_entry(0, acc=0.9), _entry(1, acc=0.5), _entry(2, acc=0.8), _entry(3, acc=0.1)]
    doomed = checkpoints_to_delete(entries, CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc"))
    assert [entry.report_index for entry in doomed] == [1]
    doomed_min = checkpoints_to_delete(
        entries, CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc", checkpoint_score_order="min")
    )
    assert [entry.report_index for entry in doomed_min] == [0, 1, 2]


def test_recorder_commits_in_order_and_result_reads_back(tmp_path: Path) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    recorder = RunRecorder(storage, CheckpointConfig(num_to_keep=1), world_size=2)
    recorder.open()
    staged = Path(storage.staging_path("checkpoint_000001"))
    staged.mkdir(parents=True)
    (staged / "rank0.bin").write_bytes(b"0")
    recorder.commit_report(0, json.dumps({"loss": 2.0}), None)
    path = recorder.commit_report(1, json.dumps({"loss": 1.0}), "checkpoint_000001")
    assert path == str(tmp_path / "run" / "checkpoint_000001")
    assert not staged.exists()
    recorder.finish("finished")

    result = Result.from_path(tmp_path / "run")
    assert result.metrics == {"loss": 1.0}
    assert result.checkpoint is not None and os.listdir(result.checkpoint.path) == ["rank0.bin"]
    frame = result.metrics_dataframe
    assert list(frame["report_index"]) == [0, 1]
    assert list(frame["loss"]) == [2.0, 1.0]
    assert frame["checkpoint_dir_name"].isna().tolist() == [True, False]
    assert frame["checkpoint_dir_name"].iloc[1] == "checkpoint_000001"
    assert result.error is None


def test_resume_continues_report_index(tmp_path: Path) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    first = RunRecorder(storage, CheckpointConfig(), world_size=1)
    first.open()
    first.commit_report(0, "{}", None)
    first.finish("failed")
    second = RunRecorder(storage, CheckpointConfig(), world_size=1)
    assert second.next_report_index == 1
    second.open()
    second.commit_report(1, json.dumps({"x": 1}), None)
    second.finish("finished")
    assert [row["report_index"] for row in Result.from_path(tmp_path / "run").metrics_history] == [0, 1]


def test_from_path_on_a_folder_without_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no lockstep run"):
        Result.from_path(tmp_path)


def test_best_checkpoint_selection(tmp_path: Path) -> None:
    low, high = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    result = Result(metrics=None, checkpoint=high, error=None, path=str(tmp_path),
                    best_checkpoints=[(low, {"acc": 0.1}), (high, {"acc": 0.9})])
    assert result.get_best_checkpoint("acc", "max") == high
    assert result.get_best_checkpoint("acc", "min") == low
    with pytest.raises(ValueError, match="loss"):
        result.get_best_checkpoint("loss", "max")
