"""Checkpoint uploads at their edges (found in review): an ASYNC upload that fails keeps the
files whose folder report() deleted, an upload function that exits is a failure of its rank,
ranks that put one checkpoint in different places are refused, an ASYNC checkpoint committed
late does not end a preempted run before the checkpoints reported in answer to the notice, and
a run stopped mid-write leaves no half-written folder for a rerun to merge into."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, sigint_raises

import lockstep
from lockstep import Checkpoint, FailureConfig, PreemptionError, RunConfig, ScalingConfig, TrainingFailedError
from lockstep.torch import TorchTrainer

pytestmark = pytest.mark.timeout(120)


def fit(train_func: Any, storage_path: str, name: str, **run: Any) -> lockstep.Result:
    return TorchTrainer(
        train_func,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage_path, **run),
    ).fit()


def failing_upload(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
    raise ConnectionError("bucket unreachable (the test's outage)")


def report_into_a_failing_upload(config: dict[str, Any]) -> None:
    rank = lockstep.get_context().get_world_rank()
    folder = Path(config["base"], f"rank{rank}", "ckpt")
    folder.mkdir(parents=True)
    (folder / "model.pt").write_text("weights")
    lockstep.report(
        {"step": 0},
        checkpoint=Checkpoint.from_directory(str(folder)),
        checkpoint_upload_mode="ASYNC",
        checkpoint_upload_fn=failing_upload,
    )


def test_a_failed_async_upload_keeps_the_files_whose_folder_report_deleted(storage_path: str, tmp_path: Path) -> None:
    with pytest.raises(TrainingFailedError, match="bucket unreachable") as raised:
        TorchTrainer(
            report_into_a_failing_upload,
            train_loop_config={"base": str(tmp_path)},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=storage_path),
        ).fit()
    failed = raised.value.failures  # type: ignore[attr-defined]
    (rank,) = list(failed)[:1]  # the first rank whose upload failed ends the run
    assert not (tmp_path / f"rank{rank}" / "ckpt").exists(), "ASYNC deletes the reported folder by default"
    kept = tmp_path / f"rank{rank}" / "ckpt.lockstep_failed_upload"
    assert (kept / "model.pt").read_text() == "weights"
    assert str(kept) in str(raised.value)


def exiting_upload(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
    sys.exit("the uploader gave up")


def report_into_an_exiting_upload(config: dict[str, Any]) -> None:
    for step in range(2):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "m.pt").write_text("x")
            lockstep.report(
                {"step": step},
                checkpoint=Checkpoint.from_directory(folder),
                checkpoint_upload_mode="ASYNC",
                checkpoint_upload_fn=exiting_upload if step == 0 else None,
            )


def test_an_upload_function_that_exits_fails_its_rank_by_name(storage_path: str) -> None:
    with pytest.raises(TrainingFailedError, match=r"rank \d: CheckpointUploadError: SystemExit: the uploader gave up"):
        fit(report_into_an_exiting_upload, storage_path, "exits")


def upload_to_a_place_of_each_rank(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
    rank = lockstep.get_context().get_world_rank()
    place = os.path.join(lockstep.get_context().get_storage().run_path, "elsewhere", dir_name, f"rank{rank}")
    shutil.copytree(checkpoint.path, place)
    return Checkpoint(place)


def report_to_places_of_each_rank(config: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "shard.pt").write_text("x")
        lockstep.report(
            {"step": 0},
            checkpoint=Checkpoint.from_directory(folder),
            checkpoint_upload_fn=upload_to_a_place_of_each_rank,
        )


def test_ranks_that_put_one_checkpoint_in_different_places_are_refused(storage_path: str) -> None:
    refused = r"the ranks put checkpoint checkpoint_000000 in different places \(rank 0: .*rank0; rank 1: .*rank1"
    with pytest.raises(TrainingFailedError, match=refused):
        fit(report_to_places_of_each_rank, storage_path, "places")


def upload_step_0_slowly(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
    if dir_name == "step_0":
        time.sleep(3)  # reported before the notice; its commit comes after it
    place = os.path.join(lockstep.get_context().get_storage().run_path, dir_name)
    shutil.copytree(checkpoint.path, place, dirs_exist_ok=True)
    return Checkpoint(place)


def answer_a_notice_with_checkpoints(config: dict[str, Any]) -> None:
    rank = lockstep.get_context().get_world_rank()
    for step in range(5):
        notice = lockstep.get_preemption_info()
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            checkpoint = Checkpoint.from_directory(folder) if step == 0 or notice is not None else None
            lockstep.report(
                {"step": step},
                checkpoint=checkpoint,
                checkpoint_dir_name=f"step_{step}" if checkpoint is not None else None,
                checkpoint_upload_mode="ASYNC",
                checkpoint_upload_fn=upload_step_0_slowly,
            )
        if step == 0 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # this rank's notice, right after the ASYNC report
        time.sleep(0.3)


def test_a_late_async_commit_does_not_end_a_preempted_run_before_its_answer(storage_path: str) -> None:
    with pytest.raises(PreemptionError) as raised:
        fit(answer_a_notice_with_checkpoints, storage_path, "late", failure_config=FailureConfig(preemption_grace_s=60))
    record = json.loads((Path(storage_path) / "late" / "lockstep_run.json").read_text())
    assert record["latest_checkpoint"] not in (None, "step_0"), str(raised.value)
    assert (Path(storage_path) / "late" / record["latest_checkpoint"]).is_dir()


def test_a_run_stopped_mid_write_leaves_no_half_written_folder_for_a_rerun(tmp_path: Path) -> None:
    script = str(Path(__file__).parent / "scripts" / "preempted_mid_write_job.py")
    first = subprocess.run(
        [sys.executable, script, str(tmp_path), "first"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        preexec_fn=sigint_raises,
    )
    assert first.returncode != 0 and "PreemptionError" in first.stderr, first.stderr
    assert not (tmp_path / "preempted" / "epoch_0").exists(), "the stopped run left its half-written folder"
    again = subprocess.run(
        [sys.executable, script, str(tmp_path), "again"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=100
    )
    assert again.returncode == 0, again.stderr
    assert "CHECKPOINT FILES ['model0.pt', 'model1.pt']" in again.stdout, again.stdout
