"""lockstep.collective (barrier, broadcast_from_rank_zero), get_all_reported_checkpoints, and
report()'s delete_local_checkpoint_after_upload / checkpoint_upload_fn: real 2-worker runs."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import lockstep
from lockstep import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig, TrainingFailedError
from lockstep.collective import barrier, broadcast_from_rank_zero
from lockstep.context import ReportedCheckpoint, get_all_reported_checkpoints
from lockstep.errors import SessionNotActiveError
from lockstep.torch import TorchTrainer

pytestmark = pytest.mark.timeout(120)


def _gather(value: object) -> list[object]:
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _fit(
    train_fn: Any, storage_path: str, name: str, config: dict | None = None, **checkpointing: Any
) -> lockstep.Result:
    return TorchTrainer(
        train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=storage_path, checkpoint_config=CheckpointConfig(**checkpointing)),
    ).fit()


def _write_checkpoint(folder: str, rank: int, step: int) -> Checkpoint:
    Path(folder, f"rank{rank}.txt").write_text(f"step {step}")
    return Checkpoint.from_directory(folder)


# -- collectives -----------------------------------------------------------------------------------


def barrier_then_broadcast(config: dict) -> dict:
    rank = lockstep.get_context().get_world_rank()
    marker, entered = Path(config["marker"]), Path(config["marker"] + ".rank1_entered")
    if rank == 0:  # rank 1 is in the barrier (or on its way) before rank 0 writes the marker and joins it
        deadline = time.monotonic() + 60
        while not entered.exists():
            assert time.monotonic() < deadline, "rank 1 never reached the barrier"
            time.sleep(0.01)
        marker.write_text("rank 0 was here")
    else:
        entered.touch()
    barrier()
    saw_marker = marker.exists()
    first = broadcast_from_rank_zero({"run_id": "abc", "sizes": [1, 2]} if rank == 0 else {"run_id": "mine"})
    second = broadcast_from_rank_zero((lambda x: x * 10) if rank == 0 else None)  # cloudpickled
    third = broadcast_from_rank_zero(rank)
    return {"ranks": _gather([saw_marker, first, second(4), third])}


def test_barrier_waits_for_every_rank_and_broadcast_hands_out_rank_zeros_object(
    storage_path: str, tmp_path: Path
) -> None:
    result = _fit(barrier_then_broadcast, storage_path, "collectives", {"marker": str(tmp_path / "marker")})
    expected = [True, {"run_id": "abc", "sizes": [1, 2]}, 40, 0]
    assert result.return_value["ranks"] == [expected, expected]


def skip_the_barrier_on_rank_zero() -> None:
    if lockstep.get_context().get_world_rank() == 1:
        barrier()


def barrier_against_report() -> None:
    if lockstep.get_context().get_world_rank() == 0:
        barrier()
    else:
        lockstep.report({"step": 0})


@pytest.mark.parametrize(
    "train_fn, expected",
    [
        (skip_the_barrier_on_rank_zero, "returned from the train function while rank(s) 1 wait in barrier()"),
        (barrier_against_report, "waits in report #0 while rank(s) 0 wait in barrier()"),
    ],
)
def test_ranks_that_dont_meet_in_a_barrier_fail_the_run_instead_of_hanging(
    storage_path: str, train_fn: Any, expected: str
) -> None:
    with pytest.raises(TrainingFailedError, match="ReportMismatch") as caught:
        _fit(train_fn, storage_path, "mismatch")
    assert expected in str(caught.value)


def test_outside_a_run_the_new_functions_say_where_they_work() -> None:
    for call in (
        barrier,
        lambda: broadcast_from_rank_zero(1),
        get_all_reported_checkpoints,
        lambda: lockstep.report({}, delete_local_checkpoint_after_upload=True),
    ):
        with pytest.raises(SessionNotActiveError, match="train function"):
            call()


# -- get_all_reported_checkpoints ----------------------------------------------------------------


def _slow_upload_into_the_run_folder(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
    time.sleep(1.0)  # get_all_reported_checkpoints() right after report() must wait for this
    storage = lockstep.get_context().get_storage()
    destination = os.path.join(storage.run_path, dir_name)
    shutil.copytree(checkpoint.path, destination, dirs_exist_ok=True)
    return Checkpoint(destination)


def report_and_list_checkpoints() -> dict:
    rank = lockstep.get_context().get_world_rank()
    seen = []
    for step in range(4):
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = _write_checkpoint(folder, rank, step) if step != 1 else None
            if step == 2:
                lockstep.report(
                    {"step": step},
                    checkpoint=checkpoint,
                    checkpoint_upload_mode="ASYNC",
                    checkpoint_upload_fn=_slow_upload_into_the_run_folder,
                )
            else:
                lockstep.report({"step": step}, checkpoint=checkpoint)
        reported = get_all_reported_checkpoints()
        assert all(isinstance(item, ReportedCheckpoint) for item in reported)
        seen.append(
            [
                (
                    item.metrics,
                    sorted(os.listdir(item.checkpoint.path)),
                    Path(item.checkpoint.path, f"rank{rank}.txt").read_text(),
                )
                for item in reported
            ]
        )
    return {"ranks": _gather(seen), "last": reported[-1].checkpoint.path}


def test_every_rank_lists_the_kept_checkpoints_in_order_once_uploads_are_done(storage_path: str) -> None:
    result = _fit(report_and_list_checkpoints, storage_path, "listed", num_to_keep=2)

    def listed(*steps: int) -> list:
        return [({"step": step}, ["rank0.txt", "rank1.txt"]) for step in steps]

    expected = [listed(0), listed(0), listed(0, 2), listed(2, 3)]  # step 1 had no checkpoint; num_to_keep=2
    for seen in result.return_value["ranks"]:
        assert [[entry[:2] for entry in after] for after in seen] == [
            [(metrics, files) for metrics, files in after] for after in expected
        ]
        assert [[entry[2] for entry in after] for after in seen] == [
            [f"step {metrics['step']}" for metrics, _ in after] for after in expected
        ]
    assert result.return_value["last"] == result.checkpoint.path
    assert [metrics["step"] for _, metrics in result.best_checkpoints] == [2, 3]


# -- delete_local_checkpoint_after_upload and checkpoint_upload_fn -------------------------------


def report_with_and_without_deleting(config: dict) -> dict:
    rank = lockstep.get_context().get_world_rank()
    cases = [("SYNC", None), ("SYNC", True), ("ASYNC", None), ("ASYNC", False)]
    still_there = []
    for step, (mode, delete) in enumerate(cases):
        folder = tempfile.mkdtemp(dir=config["scratch"])
        lockstep.report(
            {"step": step},
            checkpoint=_write_checkpoint(folder, rank, step),
            checkpoint_upload_mode=mode,
            delete_local_checkpoint_after_upload=delete,
        )
        still_there.append(os.path.isdir(folder))
    try:  # a folder holding the run folder is refused before anything is written
        lockstep.report(
            {"step": 9},
            checkpoint=Checkpoint.from_directory(config["storage_path"]),
            delete_local_checkpoint_after_upload=True,
        )
    except ValueError as error:
        refused = str(error)
    return {"ranks": _gather(still_there), "refused": refused}


def test_delete_local_checkpoint_after_upload_removes_the_folder_and_the_default_is_rays(
    storage_path: str, tmp_path: Path
) -> None:
    config = {"scratch": str(tmp_path), "storage_path": storage_path}
    result = _fit(report_with_and_without_deleting, storage_path, "deleting", config)
    # Ray's defaults: kept after a SYNC upload, deleted after an ASYNC one.
    assert result.return_value["ranks"] == [[True, False, False, True]] * 2
    assert "contains the run folder" in result.return_value["refused"]
    assert Path(result.checkpoint.path, "rank1.txt").read_text() == "step 3"
    for _, metrics in result.best_checkpoints:
        assert sorted(os.listdir(Path(result.path, f"checkpoint_{metrics['step']:06d}"))) == ["rank0.txt", "rank1.txt"]


def _upload_elsewhere(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
    context = lockstep.get_context()
    destination = Path(context.get_metadata()["elsewhere"], dir_name)
    shutil.copytree(checkpoint.path, destination, dirs_exist_ok=True)
    Path(destination, f"uploaded_by_{context.get_world_rank()}").write_text(dir_name)
    return Checkpoint(str(destination))


def report_through_an_upload_fn() -> dict:
    rank = lockstep.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as folder:
        lockstep.report(
            {"step": 0},
            checkpoint=_write_checkpoint(folder, rank, 0),
            checkpoint_dir_name="mine",
            checkpoint_upload_fn=_upload_elsewhere,
        )
    return {
        "latest": lockstep.get_checkpoint().path,
        "listed": [item.checkpoint.path for item in get_all_reported_checkpoints()],
    }


def test_checkpoint_upload_fn_uploads_and_its_checkpoint_is_what_the_run_records(
    storage_path: str, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    result = TorchTrainer(
        report_through_an_upload_fn,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="upload_fn", storage_path=storage_path),
        metadata={"elsewhere": str(elsewhere)},
    ).fit()
    uploaded = elsewhere / "mine"
    assert sorted(os.listdir(uploaded)) == ["rank0.txt", "rank1.txt", "uploaded_by_0", "uploaded_by_1"]
    assert result.checkpoint.path == str(uploaded)
    assert result.return_value == {"latest": str(uploaded), "listed": [str(uploaded)]}
    assert not Path(result.path, "mine").exists()  # lockstep copied nothing itself
