"""Checkpoint, retention and Result, without worker processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lockstep import Checkpoint, CheckpointConfig, Result
from lockstep._internal.persist.storage import CheckpointEntry, RunStorage
from lockstep._internal.run.checkpoints import best_checkpoints, checkpoints_to_delete
from lockstep._internal.run.run_record import RunRecorder


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


def test_best_checkpoints_are_the_top_k_worst_first_as_in_ray_train() -> None:
    entries = [_entry(index, acc=score) for index, score in enumerate([3, 9, 1, 7, 5, 2])]
    top_max = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc", checkpoint_score_order="max")
    assert [entry.metrics["acc"] for entry in best_checkpoints(entries, top_max)] == [7, 9]
    top_min = CheckpointConfig(num_to_keep=3, checkpoint_score_attribute="acc", checkpoint_score_order="min")
    assert [entry.metrics["acc"] for entry in best_checkpoints(entries, top_min)] == [3, 2, 1]
    every = CheckpointConfig(checkpoint_score_attribute="acc")
    assert [entry.metrics["acc"] for entry in best_checkpoints(entries, every)] == [1, 2, 3, 5, 7, 9]
    latest = CheckpointConfig(num_to_keep=2)
    assert [entry.report_index for entry in best_checkpoints(entries, latest)] == [4, 5]


def test_best_checkpoints_break_ties_by_report_order_and_rank_a_missing_score_last() -> None:
    entries = [_entry(0, acc=5), _entry(1), _entry(2, acc=5), _entry(3, acc=float("nan"))]
    config = CheckpointConfig(num_to_keep=3, checkpoint_score_attribute="acc")
    assert [entry.report_index for entry in best_checkpoints(entries, config)] == [3, 0, 2]
    assert [
        entry.report_index
        for entry in best_checkpoints(entries, CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc"))
    ] == [0, 2]


def test_the_latest_checkpoint_is_kept_but_not_listed_among_the_best(tmp_path: Path) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score", checkpoint_score_order="max")
    recorder = RunRecorder(storage, config, world_size=1)
    recorder.open()
    for index, score in enumerate([3, 9, 1, 7, 5, 2]):
        name = f"checkpoint_{index:06d}"
        Path(storage.checkpoint_path(name)).mkdir()
        recorder.log_report(index, json.dumps({"score": score}), name)
        recorder.commit_checkpoint(name, index, {"score": score})
    recorder.finish("finished")

    for result in (recorder.result(), Result.from_path(tmp_path / "run")):
        assert [metrics["score"] for _, metrics in result.best_checkpoints] == [7, 9]
        assert [Path(checkpoint.path).name for checkpoint, _ in result.best_checkpoints] == [
            "checkpoint_000003",
            "checkpoint_000001",
        ]
        assert result.checkpoint is not None and Path(result.checkpoint.path).name == "checkpoint_000005"
        assert result.get_best_checkpoint("score", "max") == result.best_checkpoints[-1][0]
        assert result.get_best_checkpoint("score", "min") == result.best_checkpoints[0][0]
    kept = sorted(path.name for path in (tmp_path / "run").glob("checkpoint_*"))
    assert kept == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000005"], "the latest stays on disk"


def test_a_record_without_a_best_list_lists_every_kept_checkpoint(tmp_path: Path) -> None:
    storage = _run_with_one_checkpoint(tmp_path)
    record = storage.read_record()
    del record["best_checkpoints"]
    storage.write_record(record)
    result = Result.from_path(tmp_path / "run")
    assert [Path(checkpoint.path).name for checkpoint, _ in result.best_checkpoints] == ["checkpoint_000000"]


def test_recorder_commits_and_result_reads_back(tmp_path: Path) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    recorder = RunRecorder(storage, CheckpointConfig(num_to_keep=1), world_size=2)
    recorder.open()
    for index in (1, 2):
        folder = Path(storage.checkpoint_path(f"checkpoint_00000{index}"))
        folder.mkdir(parents=True)
        (folder / "rank0.bin").write_bytes(b"0")
    recorder.log_report(0, json.dumps({"loss": 2.0}), None)
    recorder.log_report(1, json.dumps({"loss": 1.0}), "checkpoint_000001")
    recorder.commit_checkpoint("checkpoint_000001", 1, {"loss": 1.0})
    recorder.log_report(2, json.dumps({"loss": 0.5}), "checkpoint_000002")
    recorder.commit_checkpoint("checkpoint_000002", 2, {"loss": 0.5})
    assert not (tmp_path / "run" / "checkpoint_000001").exists(), "num_to_keep=1 keeps only the latest"
    recorder.finish("finished")

    result = Result.from_path(tmp_path / "run")
    assert result.metrics == {"loss": 0.5}
    assert result.checkpoint is not None and os.listdir(result.checkpoint.path) == ["rank0.bin"]
    frame = result.metrics_dataframe
    assert list(frame["report_index"]) == [0, 1, 2]
    assert list(frame["loss"]) == [2.0, 1.0, 0.5]
    assert frame["checkpoint_dir_name"].isna().tolist() == [True, False, False]
    assert [metrics for _, metrics in result.best_checkpoints] == [{"loss": 0.5}]
    assert result.error is None


def _run_with_one_checkpoint(tmp_path: Path) -> RunStorage:
    """A run folder whose record holds one committed checkpoint, checkpoint_000000."""
    storage = RunStorage.for_run(str(tmp_path), "run")
    recorder = RunRecorder(storage, CheckpointConfig(), world_size=1)
    recorder.open()
    Path(storage.checkpoint_path("checkpoint_000000")).mkdir()
    recorder.log_report(0, "{}", "checkpoint_000000")
    recorder.commit_checkpoint("checkpoint_000000", 0, {})
    return storage


def test_unfinished_checkpoint_is_ignored_then_cleaned(tmp_path: Path) -> None:
    storage = _run_with_one_checkpoint(tmp_path)
    half_written = Path(storage.checkpoint_path("checkpoint_000001"))
    half_written.mkdir()
    (half_written / "model.pt").write_bytes(b"trunc")
    user_folder = Path(storage.path_of("tensorboard"))
    user_folder.mkdir()
    assert Result.from_path(tmp_path / "run").checkpoint.path.endswith("checkpoint_000000")

    second = RunRecorder(storage, CheckpointConfig(), world_size=1)
    second.open()
    assert not half_written.exists() and user_folder.exists()
    assert second.latest_checkpoint.path.endswith("checkpoint_000000")


def test_missing_latest_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    storage = _run_with_one_checkpoint(tmp_path)
    Path(storage.checkpoint_path("checkpoint_000000")).rmdir()
    with pytest.raises(ValueError, match="checkpoint_000000 is missing. Restore that folder"):
        RunRecorder(storage, CheckpointConfig(), world_size=1).check_resumable()


def test_resume_continues_report_index(tmp_path: Path) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    first = RunRecorder(storage, CheckpointConfig(), world_size=1)
    first.open()
    first.log_report(0, "{}", None)
    first.finish("failed")
    second = RunRecorder(storage, CheckpointConfig(), world_size=1)
    assert second.next_report_index == 1
    second.open()
    second.log_report(1, json.dumps({"x": 1}), None)
    second.finish("finished")
    assert [row["report_index"] for row in Result.from_path(tmp_path / "run").metrics_history] == [0, 1]


def test_from_path_on_a_folder_without_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no lockstep run"):
        Result.from_path(tmp_path)


def test_best_checkpoint_selection(tmp_path: Path) -> None:
    low, high = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    result = Result(
        metrics=None,
        checkpoint=high,
        error=None,
        path=str(tmp_path),
        best_checkpoints=[(low, {"acc": 0.1}), (high, {"acc": 0.9})],
    )
    assert result.get_best_checkpoint("acc", "max") == high
    assert result.get_best_checkpoint("acc", "min") == low
    with pytest.raises(ValueError, match="loss"):
        result.get_best_checkpoint("loss", "max")


def test_metrics_are_checked_and_converted() -> None:
    import numpy
    import torch

    from lockstep._internal.rank.metrics_json import encode_metrics

    assert json.loads(
        encode_metrics({"loss": torch.tensor(0.5), "acc": numpy.float32(0.25), "nested": {"a": [1]}})
    ) == {"loss": 0.5, "acc": 0.25, "nested": {"a": [1]}}
    with pytest.raises(TypeError, match="takes a dict of metrics, got list"):
        encode_metrics([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"metric names must be strings, got the key 3"):
        encode_metrics({3: 1.0})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="metric 'weights' is a Tensor"):
        encode_metrics({"weights": torch.ones(3)})


def test_unpicklable_objects_are_named() -> None:
    import threading

    from lockstep._internal.payload import TrainJob, serialize_payload
    from lockstep.backend import BackendConfig

    lock = threading.Lock()

    def train() -> None:
        with lock:
            pass

    payload = TrainJob(train, None, BackendConfig(), False, RunStorage("/tmp/x"))
    with pytest.raises(TypeError, match="the variable 'lock' captured by the train function can't be sent"):
        serialize_payload(payload)


def test_a_history_line_that_is_no_report_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    storage.write_record({"status": "failed", "checkpoints": []})
    rows = [json.dumps({"report_index": index, "metrics": {}}) for index in range(3)]
    rows[1] = rows[1][:20] + rows[1]  # a torn append that an older rerun wrote after
    Path(storage.path_of("reports.jsonl")).write_text("".join(row + "\n" for row in rows))
    assert [report["report_index"] for report in storage.read_reports()] == [0, 2]
    assert "line 2 is not a report (skipped)" in caplog.text


def test_a_large_conjugate_view_tensor_travels_in_the_payload() -> None:
    import torch

    from lockstep._internal.payload import TrainJob, deserialize_payload, serialize_payload
    from lockstep.backend import BackendConfig

    values = torch.randn(1 << 17, dtype=torch.complex64)  # 1 MiB: large enough to be shared
    config = {"conj": values.conj(), "neg": torch.randn(1 << 18)._neg_view()}
    job = TrainJob(print, config, BackendConfig(), False, RunStorage("/tmp/x"))
    back = deserialize_payload(bytearray(serialize_payload(job)))
    sent = back.train_loop_config
    assert torch.equal(sent["conj"], values.conj()) and torch.equal(sent["neg"], config["neg"])
