"""Storage for real: a local S3 server (moto), ASYNC uploads, storage faults, bad paths."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from s3_server import apply_env, restore_env, s3_server

import lockstep
from lockstep import (
    Checkpoint,
    CheckpointConfig,
    CheckpointUploadMode,
    Result,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from lockstep.torch import TorchTrainer

pytestmark = pytest.mark.timeout(150)


def checkpoint_every_step(config: dict) -> None:
    rank = lockstep.get_context().get_world_rank()
    start = lockstep.get_checkpoint()
    first = 0
    if start is not None:
        with start.as_directory() as folder:
            first = int(Path(folder, "step.txt").read_text()) + 1
    mode = CheckpointUploadMode(config.get("mode", "SYNC"))
    for step in range(first, first + config["steps"]):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            Path(folder, f"rank{rank}.bin").write_bytes(os.urandom(config.get("bytes", 1000)))
            lockstep.report(
                {"step": step, "score": config.get("scores", [0] * 99)[step]},
                checkpoint=Checkpoint.from_directory(folder),
                checkpoint_upload_mode=mode,
            )


@pytest.mark.parametrize("mode", ["SYNC", "ASYNC"])
def test_s3_run_checkpoints_result_and_resume(s3_env: dict[str, str], mode: str) -> None:
    run_config = RunConfig(name=f"s3-{mode}", storage_path="s3://runs/prefix")
    config = {"steps": 2, "mode": mode, "bytes": 200_000}
    result = TorchTrainer(
        checkpoint_every_step,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config,
    ).fit()
    assert result.path == f"s3://runs/prefix/s3-{mode}"
    assert result.checkpoint.uri == f"s3://runs/prefix/s3-{mode}/checkpoint_000001"
    with result.checkpoint.as_directory() as folder:
        assert sorted(os.listdir(folder)) == ["rank0.bin", "rank1.bin", "step.txt"]
        assert Path(folder, "step.txt").read_text() == "1"
        assert os.path.getsize(Path(folder, "rank1.bin")) == 200_000
    assert not os.path.exists(folder), "as_directory() must remove its download"

    resumed = TorchTrainer(
        checkpoint_every_step,
        train_loop_config={**config, "steps": 1},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config,
    ).fit()
    assert list(resumed.metrics_dataframe["report_index"]) == [0, 1, 2]
    assert list(resumed.metrics_dataframe["step"]) == [0, 1, 2]

    read_back = Result.from_path(f"s3://runs/prefix/s3-{mode}")
    assert read_back.metrics == {"step": 2, "score": 0}
    assert [metrics["step"] for _, metrics in read_back.best_checkpoints] == [0, 1, 2]


def local_log_folders() -> set[Path]:
    """The local folders that runs on remote storage write their workers' logs into first."""
    return set(Path(tempfile.gettempdir()).glob("lockstep_logs_*"))


def test_missing_bucket_fails_before_start(s3_env: dict[str, str]) -> None:
    before = local_log_folders()
    trainer = TorchTrainer(checkpoint_every_step, run_config=RunConfig(storage_path="s3://no-such-bucket/x"))
    with pytest.raises(ValueError, match="bucket exists"):
        trainer.fit()
    assert local_log_folders() == before, "a run refused before it started left its local log folder behind"


def test_logs_storage_refuses_at_the_end_stay_local_and_the_run_keeps_its_result(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lockstep._internal.persist.storage import RunStorage
    from lockstep.errors import StorageUnreachableError

    def unreachable(storage: RunStorage, local_dir: str) -> None:
        raise StorageUnreachableError(f"{storage.display_path} did not answer (the test's outage)")

    monkeypatch.setattr(RunStorage, "upload_logs", unreachable)
    caplog.set_level("WARNING", logger="lockstep")
    result = TorchTrainer(
        checkpoint_every_step,
        train_loop_config={"steps": 1},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="logs-stay-local", storage_path="s3://runs/prefix"),
    ).fit()
    assert result.error is None and result.metrics == {"step": 0, "score": 0}
    told = [record.getMessage() for record in caplog.records if "could not be copied" in record.getMessage()]
    assert len(told) == 1 and "the test's outage" in told[0], told
    folder = Path(told[0].rsplit("they stay in ", 1)[1].rstrip("."))
    try:
        assert sorted(path.name for path in folder.iterdir()) == ["rank_0.log", "rank_1.log"]
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)  # the folder and its owner file


def prints_its_token(config: dict) -> None:
    print(f"output of {config['token']}", flush=True)
    lockstep.report({"done": 1})


def test_a_rerun_on_s3_keeps_the_earlier_runs_logs(s3_env: dict[str, str]) -> None:
    import s3fs

    run_config = RunConfig(name="logs-of-two-runs", storage_path="s3://runs/prefix")
    for token in ("the first run", "the second run"):
        result = TorchTrainer(
            prints_its_token,
            train_loop_config={"token": token},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=run_config,
        ).fit()
        assert result.error is None
    store = s3fs.S3FileSystem(skip_instance_cache=True)
    log = store.cat_file("runs/prefix/logs-of-two-runs/logs/rank_0.log").decode()
    assert log.index("output of the first run") < log.index("output of the second run"), log


def test_wrong_credentials_fail_before_start() -> None:
    import s3fs

    with s3_server(check_credentials=True) as env:
        previous = apply_env({**env, "AWS_EC2_METADATA_DISABLED": "true"})
        try:
            wrong_keys = s3fs.S3FileSystem(skip_instance_cache=True, key="wrong", secret="wrong")
            trainer = TorchTrainer(
                checkpoint_every_step, run_config=RunConfig(storage_path="s3://runs/x", storage_filesystem=wrong_keys)
            )
            with pytest.raises(ValueError, match="access denied .* Check the credentials"):
                trainer.fit()
        finally:
            restore_env(previous)


def test_async_uploads_commit_in_order_after_the_temp_folder_is_gone(storage_path: str) -> None:
    result = TorchTrainer(
        checkpoint_every_step,
        train_loop_config={"steps": 4, "mode": "ASYNC", "bytes": 2_000_000, "scores": [3, 9, 1, 5]},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="async",
            storage_path=storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score"),
        ),
    ).fit()
    run = Path(storage_path, "async")
    assert sorted(path.name for path in run.glob("checkpoint_*")) == ["checkpoint_000001", "checkpoint_000003"]
    assert [metrics["score"] for _, metrics in result.best_checkpoints] == [5, 9], "best last, as in Ray Train"
    assert Path(result.checkpoint.path, "step.txt").read_text() == "3"
    assert os.path.getsize(Path(result.checkpoint.path, "rank0.bin")) == 2_000_000


def write_then_block_storage(config: dict) -> None:
    if lockstep.get_context().get_world_rank() == 0:  # before report #0, so no rank is past it yet
        Path(config["blocker"]).write_text("a file where the next checkpoint folder must go")
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "model.pt").write_text("good")
        lockstep.report({"step": 0}, checkpoint=Checkpoint.from_directory(folder))
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "model.pt").write_text("never committed")
        lockstep.report(
            {"step": 1},
            checkpoint=Checkpoint.from_directory(folder),
            checkpoint_dir_name="checkpoint_000001",
            checkpoint_upload_mode=config["mode"],
        )


@pytest.mark.parametrize("mode", ["SYNC", "ASYNC"])
def test_storage_failure_names_the_checkpoint_and_keeps_earlier_ones(storage_path: str, mode: str) -> None:
    run = Path(storage_path, "faulty")
    trainer = TorchTrainer(
        write_then_block_storage,
        train_loop_config={"blocker": str(run / "checkpoint_000001"), "mode": mode},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="faulty", storage_path=storage_path),
    )
    with pytest.raises(TrainingFailedError, match="writing checkpoint checkpoint_000001 to .* failed"):
        trainer.fit()
    recorded = Result.from_path(run)
    assert Path(recorded.checkpoint.path, "model.pt").read_text() == "good"
    assert recorded.checkpoint.path.endswith("checkpoint_000000")


def test_bad_storage_paths_fail_before_start(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        TorchTrainer(checkpoint_every_step, run_config=RunConfig(storage_path=str(a_file))).fit()
    with pytest.raises(ValueError, match="storage_path='/proc/lockstep'"):
        TorchTrainer(checkpoint_every_step, run_config=RunConfig(storage_path="/proc/lockstep")).fit()


def test_unshared_storage_is_detected_by_the_worker(tmp_path: Path) -> None:
    from node_local_fs import NodeLocalFileSystem

    filesystem = NodeLocalFileSystem(str(tmp_path / "disks"))
    trainer = TorchTrainer(
        checkpoint_every_step,
        train_loop_config={"steps": 1},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="unshared", storage_path="runs", storage_filesystem=filesystem),
    )
    with pytest.raises(TrainingFailedError, match=r"rank 1 can't see the run folder .* must be shared"):
        trainer.fit()


def reuse_a_checkpoint_name() -> None:
    for step in range(2):
        with tempfile.TemporaryDirectory() as folder:
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder), checkpoint_dir_name="best")


def test_reusing_a_checkpoint_name_is_refused(storage_path: str) -> None:
    with pytest.raises(TrainingFailedError, match="already has a checkpoint of that name"):
        TorchTrainer(reuse_a_checkpoint_name, run_config=RunConfig(storage_path=storage_path)).fit()


def register_in_place(config: dict) -> None:
    folder = Path(config["folder"])
    folder.mkdir(exist_ok=True)
    Path(folder, "weights.bin").write_text("in place")
    lockstep.report({"step": 0}, checkpoint=Checkpoint.from_directory(folder), checkpoint_upload_mode="NO_UPLOAD")


def test_no_upload_registers_the_checkpoint_where_it_is(storage_path: str, tmp_path: Path) -> None:
    result = TorchTrainer(
        register_in_place,
        train_loop_config={"folder": str(tmp_path / "mine")},
        run_config=RunConfig(name="inplace", storage_path=storage_path),
    ).fit()
    assert result.checkpoint.path == str(tmp_path / "mine")
    assert Result.from_path(Path(storage_path, "inplace")).checkpoint.path == str(tmp_path / "mine")


def test_run_record_naming_a_missing_checkpoint_fails_before_start(storage_path: str) -> None:
    import shutil

    run_config = RunConfig(name="lost", storage_path=storage_path)
    result = TorchTrainer(checkpoint_every_step, train_loop_config={"steps": 1}, run_config=run_config).fit()
    shutil.rmtree(result.checkpoint.path)
    with pytest.raises(ValueError, match="checkpoint_000000 is missing. Restore that folder, or start a new run"):
        TorchTrainer(checkpoint_every_step, train_loop_config={"steps": 1}, run_config=run_config).fit()


def test_staging_copies_of_ranks_that_died_are_swept_when_a_rank_stages_there(tmp_path: Path) -> None:
    """An ASYNC upload's private copy outlives a SIGKILLed rank; the next rank that stages into
    the same folder removes it (this host's dead processes only, never a live one's or another
    host's)."""
    import socket
    import subprocess
    import sys

    from lockstep._internal.rank import upload_staging

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        left = {
            name: tmp_path / f".lockstep_upload_{name}"
            for name in (f"{host}_{dead.pid}_x1", f"{host}_{alive.pid}_x2", f"otherhost_{dead.pid}_x3")
        }
        for folder in left.values():
            (folder / "sub").mkdir(parents=True)
            (folder / "sub" / "model.pt").write_bytes(b"weights")
        mine = tmp_path / "checkpoint"
        mine.mkdir()
        (mine / "model.pt").write_bytes(b"new weights")
        upload_staging._swept.discard(str(tmp_path))

        staged = Path(upload_staging.private_copy(str(mine)))

        assert staged.parent == tmp_path and staged.name.startswith(f".lockstep_upload_{host}_{os.getpid()}_")
        assert (staged / "model.pt").read_bytes() == b"new weights"
        assert not left[f"{host}_{dead.pid}_x1"].exists(), "a dead rank's copy stayed"
        assert left[f"{host}_{alive.pid}_x2"].exists() and left[f"otherhost_{dead.pid}_x3"].exists()
    finally:
        alive.kill()
        alive.wait()
