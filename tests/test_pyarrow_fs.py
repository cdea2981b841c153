"""pyarrow filesystems as Ray Train takes them (``RunConfig(storage_filesystem=...)``,
``Checkpoint(path, filesystem=...)``, ``Result.from_path(path, storage_filesystem=...)``):
S3 (against the local moto server), ``LocalFileSystem`` and ``SubTreeFileSystem``, with real
2-worker runs whose ranks both write checkpoint files."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import cloudpickle
import pytest

import lockstep
from lockstep import Checkpoint, Result, RunConfig, ScalingConfig
from lockstep._internal.persist.filesystems import resolve_filesystem
from lockstep.torch import TorchTrainer

pafs = pytest.importorskip("pyarrow.fs")

pytestmark = pytest.mark.timeout(120)


def two_rank_checkpoints(config: dict) -> None:
    """Each step: both ranks write a file into the checkpoint; resumes after the last step."""
    rank = lockstep.get_context().get_world_rank()
    start = lockstep.get_checkpoint()
    first = 0
    if start is not None:
        with start.as_directory() as folder:
            first = int(Path(folder, "step.txt").read_text()) + 1
    for step in range(first, first + config["steps"]):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            Path(folder, f"rank{rank}.txt").write_text(f"rank {rank} step {step}")
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder))


def fit(storage_path: str, filesystem: object, name: str, steps: int = 2) -> Result:
    """A 2-worker run with ``filesystem`` as RunConfig.storage_filesystem."""
    run_config = RunConfig(name=name, storage_path=storage_path, storage_filesystem=filesystem)
    return TorchTrainer(
        two_rank_checkpoints,
        train_loop_config={"steps": steps},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config,
    ).fit()


def assert_checkpoint_holds(checkpoint: Checkpoint, step: int) -> None:
    """The checkpoint has both ranks' files of ``step``."""
    with checkpoint.as_directory() as folder:
        assert sorted(os.listdir(folder)) == ["rank0.txt", "rank1.txt", "step.txt"]
        assert Path(folder, "step.txt").read_text() == str(step)
        assert Path(folder, "rank1.txt").read_text() == f"rank 1 step {step}"


def pyarrow_s3(env: dict[str, str]) -> object:
    """A pyarrow S3FileSystem for the moto server, the way Ray's docs reach an S3-compatible endpoint."""
    return pafs.S3FileSystem(
        endpoint_override=env["AWS_ENDPOINT_URL"].split("://", 1)[1],
        scheme="http",
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_DEFAULT_REGION"],
    )


# -- S3 -----------------------------------------------------------------------------------------


def test_pyarrow_s3_run_writes_both_ranks_checkpoints_reads_back_and_resumes(s3_env: dict[str, str]) -> None:
    filesystem = pyarrow_s3(s3_env)
    result = fit("runs/pyarrow", filesystem, "s3-run")
    assert result.error is None
    assert result.path == "s3://runs/pyarrow/s3-run"
    assert result.checkpoint.uri == "s3://runs/pyarrow/s3-run/checkpoint_000001"
    assert_checkpoint_holds(result.checkpoint, 1)
    # what the driver wrote through the wrapper: the run record (the commit point), the history
    names = {info.base_name for info in filesystem.get_file_info(pafs.FileSelector("runs/pyarrow/s3-run"))}
    assert {"lockstep_run.json", "reports.jsonl", "checkpoint_000000", "checkpoint_000001"} <= names

    for path in (result.path, "runs/pyarrow/s3-run"):
        read_back = Result.from_path(path, storage_filesystem=filesystem)
        assert read_back.metrics == {"step": 1}
        assert [metrics["step"] for _, metrics in read_back.best_checkpoints] == [0, 1]
        assert_checkpoint_holds(read_back.checkpoint, 1)
    assert_checkpoint_holds(Checkpoint("runs/pyarrow/s3-run/checkpoint_000000", filesystem=filesystem), 0)

    resumed = fit("runs/pyarrow", filesystem, "s3-run", steps=1)  # workers read the checkpoint through it
    assert list(resumed.metrics_dataframe["step"]) == [0, 1, 2]
    assert_checkpoint_holds(resumed.checkpoint, 2)


def test_subtree_of_pyarrow_s3_is_s3_under_its_base(s3_env: dict[str, str]) -> None:
    subtree = pafs.SubTreeFileSystem("runs/tree", pyarrow_s3(s3_env))
    result = fit("experiments", subtree, "subtree-run", steps=1)
    assert result.path == "s3://runs/tree/experiments/subtree-run"
    assert_checkpoint_holds(result.checkpoint, 0)
    assert Result.from_path("experiments/subtree-run", storage_filesystem=subtree).metrics == {"step": 0}
    assert Result.from_path(result.path, storage_filesystem=subtree).metrics == {"step": 0}


def test_pyarrow_s3_wrapper_survives_pickling_with_its_endpoint(s3_env: dict[str, str]) -> None:
    filesystem, path = resolve_filesystem("runs/pickled/file.txt", pyarrow_s3(s3_env))
    filesystem.pipe_file(path, b"hello")
    copy = pickle.loads(cloudpickle.dumps(filesystem))  # as workers get it inside the TrainJob
    assert copy.cat_file(path) == b"hello"
    assert copy.unstrip_protocol(path) == "s3://runs/pickled/file.txt"


def test_missing_bucket_through_pyarrow_fails_before_start(s3_env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="bucket does not exist"):
        fit("no-such-bucket/x", pyarrow_s3(s3_env), "never")


# -- local disk ---------------------------------------------------------------------------------


def test_pyarrow_local_filesystem_run_is_a_local_run(tmp_path: Path) -> None:
    result = fit(str(tmp_path / "results"), pafs.LocalFileSystem(), "local-run")
    run_folder = tmp_path / "results" / "local-run"
    assert result.path == str(run_folder)
    assert sorted(os.listdir(run_folder / "checkpoint_000001")) == ["rank0.txt", "rank1.txt", "step.txt"]
    assert (run_folder / "logs").is_dir(), "on local disk worker logs are written straight into the run folder"
    assert len((run_folder / "reports.jsonl").read_text().splitlines()) == 2
    assert Result.from_path(run_folder, storage_filesystem=pafs.LocalFileSystem()).metrics == {"step": 1}


def test_subtree_of_local_disk_puts_the_run_under_its_base(tmp_path: Path) -> None:
    subtree = pafs.SubTreeFileSystem(str(tmp_path / "base"), pafs.LocalFileSystem())
    result = fit("results", subtree, "subtree-local", steps=1)
    run_folder = tmp_path / "base" / "results" / "subtree-local"
    assert result.path == str(run_folder)
    assert_checkpoint_holds(result.checkpoint, 0)
    for path in ("results/subtree-local", result.path):
        assert Result.from_path(path, storage_filesystem=subtree).metrics == {"step": 0}
    assert_checkpoint_holds(Checkpoint("results/subtree-local/checkpoint_000000", filesystem=subtree), 0)


def test_a_filesystem_that_is_neither_fsspec_nor_pyarrow_is_refused() -> None:
    with pytest.raises(ValueError, match="fsspec filesystem .* or a pyarrow.fs one"):
        resolve_filesystem("/tmp/x", filesystem=object())
