"""Every committed checkpoint is verifiable: its manifest (each file's size and XXH3-64, written at
the commit) is checked wherever a checkpoint is loaded, and `lockstep verify` checks a whole run.
Real runs on local disk and on the S3 test server; the damage is done to the real files."""

from __future__ import annotations

import json
import logging
import os
import pickle
import tempfile
from pathlib import Path

import pytest
import xxhash

import lockstep
from lockstep import Checkpoint, CheckpointCorruptedError, Result, RunConfig, ScalingConfig, TrainingFailedError
from lockstep._internal.persist.manifest import MANIFEST_DIR, merged, problem_of
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.run.run_record import RunRecorder
from lockstep.cli import main as cli_main
from lockstep.config import CheckpointConfig
from lockstep.torch import TorchTrainer

pytestmark = pytest.mark.timeout(120)


def write_checkpoints(config: dict) -> None:
    """Each rank writes its own file and a shared one; resume reads them (a damaged checkpoint fails here)."""
    rank = lockstep.get_context().get_world_rank()
    first = 0
    start = lockstep.get_checkpoint()
    if start is not None:
        with start.as_directory() as folder:
            first = int(Path(folder, "step.txt").read_text()) + 1
    for step in range(first, first + config["steps"]):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            Path(folder, "sub").mkdir()
            Path(folder, "sub", f"rank{rank}.bin").write_bytes(os.urandom(config.get("bytes", 3000)))
            mode = config.get("modes", ["SYNC"])[step % len(config.get("modes", ["SYNC"]))]
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder), checkpoint_upload_mode=mode)


def fit(storage_path: str, name: str, **config: object) -> Result:
    return TorchTrainer(
        write_checkpoints,
        train_loop_config={"steps": 2, **config},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage_path),
    ).fit()


def verify(run: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = cli_main(["verify", run])
    captured = capsys.readouterr()
    assert code != 2, captured.err
    return code, captured.out.splitlines()


def test_local_checkpoints_are_verified_and_damage_is_named(
    storage_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = fit(storage_path, "local", steps=3, modes=["SYNC", "ASYNC"])
    run = Path(storage_path, "local")
    manifest = json.loads((run / MANIFEST_DIR / "checkpoint_000002.json").read_text())
    assert sorted(manifest["files"]) == ["step.txt", "sub/rank0.bin", "sub/rank1.bin"]
    rank1 = (run / "checkpoint_000002" / "sub" / "rank1.bin").read_bytes()
    assert manifest["algorithm"] == "xxh3_64"
    assert manifest["files"]["sub/rank1.bin"] == [
        {"size": 3000, "xxh3_64": xxhash.xxh3_64_intdigest(rank1), "ranks": [1]}
    ]
    # both ranks wrote step.txt with the same bytes: one version, written by both
    assert [version["ranks"] for version in manifest["files"]["step.txt"]] == [[0, 1]]
    assert sorted(os.listdir(result.checkpoint.path)) == ["step.txt", "sub"], "the manifest is not in the folder"

    code, lines = verify(str(run), capsys)
    assert code == 0
    assert [line.split()[:2] for line in lines] == [[f"checkpoint_00000{i}", "whole"] for i in range(3)]

    latest = Path(result.checkpoint.path)
    (latest / "sub" / "rank1.bin").write_bytes(b"short")  # truncated
    older = Path(run, "checkpoint_000001")
    data = bytearray((older / "sub" / "rank0.bin").read_bytes())
    data[100] ^= 0xFF
    (older / "sub" / "rank0.bin").write_bytes(bytes(data))  # same size, one byte flipped
    (Path(run, "checkpoint_000000") / "step.txt").unlink()  # lost

    with (
        pytest.raises(
            CheckpointCorruptedError,
            match=r"sub/rank1.bin: 5 bytes, 3000 when committed "
            r"\(written by rank 1\).*lockstep verify RUN",
        ) as damaged,
        result.checkpoint.as_directory(),
    ):
        pass
    assert damaged.value.problems == ["sub/rank1.bin: 5 bytes, 3000 when committed (written by rank 1)"]
    assert pickle.loads(pickle.dumps(damaged.value)).problems == damaged.value.problems
    with pytest.raises(CheckpointCorruptedError, match=r"sub/rank0.bin: checksum differs"):
        Result.from_path(str(run)).best_checkpoints[1][0].to_directory(tempfile.mkdtemp(dir=storage_path))

    code, lines = verify(str(run), capsys)
    assert code == 1
    assert "step.txt: missing (written by rank 0, 1)" in lines[0] and "DAMAGED" in lines[0]
    assert "checksum differs" in lines[1] and "5 bytes, 3000" in lines[2]

    # a rerun resumes from the latest checkpoint: each rank's get_checkpoint() finds the damage
    with pytest.raises(TrainingFailedError, match=r"CheckpointCorruptedError.*sub/rank1.bin: 5 bytes"):
        fit(storage_path, "local", steps=1)


def test_s3_checkpoints_are_verified(s3_env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    import s3fs

    result = fit("s3://runs/verify", "s3", bytes=200_000, modes=["ASYNC", "SYNC"])
    code, lines = verify("s3://runs/verify/s3", capsys)
    assert code == 0 and len(lines) == 2 and all(" whole " in line for line in lines)
    with result.checkpoint.as_directory() as folder:
        assert sorted(os.listdir(folder)) == ["step.txt", "sub"]

    s3 = s3fs.S3FileSystem(skip_instance_cache=True)
    s3.pipe_file("runs/verify/s3/checkpoint_000001/sub/rank0.bin", os.urandom(200_000))
    with pytest.raises(CheckpointCorruptedError, match=r"sub/rank0.bin: checksum differs .*\(written by rank 0\)"):
        result.checkpoint.to_directory()
    code, lines = verify("s3://runs/verify/s3", capsys)
    assert code == 1 and " whole " in lines[0] and "DAMAGED" in lines[1]


def register_in_place(config: dict) -> None:
    Path(config["folder"]).mkdir(exist_ok=True)
    Path(config["folder"], "model.txt").write_text("weights")
    lockstep.report(
        {"step": 0}, checkpoint=Checkpoint.from_directory(config["folder"]), checkpoint_upload_mode="NO_UPLOAD"
    )


def test_checkpoint_without_manifest_loads_with_one_warning(
    storage_path: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    result = TorchTrainer(
        register_in_place,
        train_loop_config={"folder": str(tmp_path / "mine")},
        run_config=RunConfig(name="inplace", storage_path=storage_path),
    ).fit()
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        for _ in range(3):
            with result.checkpoint.as_directory() as folder:
                assert Path(folder, "model.txt").read_text() == "weights"
    warnings = [record.getMessage() for record in caplog.records if "no manifest" in record.getMessage()]
    assert len(warnings) == 1 and str(tmp_path / "mine") in warnings[0]
    code, lines = verify(str(Path(storage_path, "inplace")), capsys)
    assert code == 0 and "unverified" in lines[0]
    # a user's own folder, not from a run, loads silently
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="lockstep"),
        Checkpoint.from_directory(tmp_path / "mine").as_directory(),
    ):
        pass
    assert not caplog.records


def test_files_written_differently_by_two_ranks_match_either_version() -> None:
    files = merged({1: [("model.pt", 10, 7), ("b", 1, 1)], 0: [("model.pt", 10, 9)], 2: [("model.pt", 10, 7)]})
    assert files["model.pt"] == [{"size": 10, "xxh3_64": 9, "ranks": [0]}, {"size": 10, "xxh3_64": 7, "ranks": [1, 2]}]
    assert problem_of("model.pt", files["model.pt"], (10, 7)) is None
    assert problem_of("model.pt", files["model.pt"], (10, 8)) == (
        "model.pt: checksum differs (xxh3_64 0000000000000008, 0000000000000009 when committed) "
        "(written by rank 0, 1, 2)"
    )
    assert problem_of("b", files["b"], None) == "b: missing (written by rank 1)"


def test_a_report_listing_checkpoint_files_travels_as_json() -> None:
    from lockstep._internal.wire import codec, protocol

    report = protocol.Report(1, 4, None, "checkpoint_000004", "written", files=[["sub/rank1.bin", 3000, 123]])
    encoded = codec.encode(report)
    assert json.loads(encoded)["files"] == [["sub/rank1.bin", 3000, 123]]
    assert codec.decode(encoded) == report


def test_checksums_of_files_and_streams_are_the_libraries_own(tmp_path: Path) -> None:
    import io
    import zlib

    from lockstep._internal.persist.checksums import PIECE, checksum_of_file, checksum_of_stream

    for size in (0, 1, PIECE, PIECE + 1, 3 * PIECE + 12_345):
        data = os.urandom(size)
        Path(tmp_path, "f").write_bytes(data)
        assert checksum_of_file(str(tmp_path / "f")) == (size, xxhash.xxh3_64_intdigest(data)), size
        assert checksum_of_file(str(tmp_path / "f"), "crc32") == (size, zlib.crc32(data)), size
        assert checksum_of_stream(io.BytesIO(data)) == (size, xxhash.xxh3_64_intdigest(data)), size
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md4'"):
        checksum_of_file(str(tmp_path / "f"), "md4")


def test_a_manifest_written_with_crc32_is_still_checked(storage_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Manifests written before XXH3 (``"algorithm": "crc32"``) keep verifying, and damage shows."""
    import zlib

    result = fit(storage_path, "older", steps=1)
    run = Path(storage_path, "older")
    manifest_file = run / MANIFEST_DIR / "checkpoint_000000.json"
    manifest = json.loads(manifest_file.read_text())
    for path, versions in manifest["files"].items():
        data = Path(result.checkpoint.path, *path.split("/")).read_bytes()
        versions[:] = [{"size": v["size"], "crc32": zlib.crc32(data), "ranks": v["ranks"]} for v in versions]
    manifest["algorithm"] = "crc32"
    manifest_file.write_text(json.dumps(manifest))
    assert verify(str(run), capsys)[0] == 0
    data = bytearray(Path(result.checkpoint.path, "sub", "rank0.bin").read_bytes())
    data[7] ^= 1
    Path(result.checkpoint.path, "sub", "rank0.bin").write_bytes(bytes(data))
    code, lines = verify(str(run), capsys)
    assert code == 1 and "sub/rank0.bin: checksum differs (crc32 " in "\n".join(lines)


def test_the_history_is_in_the_store_before_a_record_names_a_checkpoint(s3_env: dict[str, str]) -> None:
    import s3fs

    from lockstep._internal.persist.report_log import RewritingReportLog

    s3 = s3fs.S3FileSystem(skip_instance_cache=True)
    log = RewritingReportLog(s3, "runs/flushed/reports.jsonl", ['{"report_index": 0}'])
    for index in range(1, 40):
        log.append(json.dumps({"report_index": index}))
    log.flush()  # what RunRecorder.commit_checkpoint does before the record write
    s3.invalidate_cache()
    lines = s3.cat_file("runs/flushed/reports.jsonl").decode().splitlines()
    assert [json.loads(line)["report_index"] for line in lines] == list(range(40))
    log.close()


def test_verify_calls_a_checkpoint_that_a_running_runs_retention_deleted_retired(tmp_path: Path) -> None:
    from lockstep._internal.persist.run_check import RETIRED, UNVERIFIED, check_run

    storage = RunStorage.for_run(str(tmp_path), "run")
    recorder = RunRecorder(storage, CheckpointConfig(num_to_keep=1), world_size=1)
    recorder.open()
    read_by_verify = None
    for index in range(2):
        name = f"checkpoint_{index:06d}"
        Path(storage.checkpoint_path(name)).mkdir()
        recorder.log_report(index, "{}", name)
        recorder.commit_checkpoint(name, index, {})
        read_by_verify = read_by_verify or storage.read_record()  # verify read the record; retention went on
    assert read_by_verify is not None
    checks = check_run(storage, read_by_verify)
    assert [(check.dir_name, check.state, check.bad) for check in checks] == [("checkpoint_000000", RETIRED, False)]
    assert [check.state for check in check_run(storage, storage.read_record() or {})] == [UNVERIFIED]
