"""Elastic runs, ScalingConfig(num_workers=(min, max)), on the local executor: the resources are
the CPUs the driver may run on (its affinity), which the test narrows and widens mid-run."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import lockstep
from lockstep import Checkpoint, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from lockstep.torch import TorchTrainer

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


def wait_for(path: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def shrink_then_grow(config: dict[str, Any]) -> None:
    """Steps 0-5, a checkpoint each. First attempt (2 workers): stops after step 1 until rank 1
    is killed. Second (1 worker): after step 3 waits until the CPUs are back."""
    context = lockstep.get_context()
    world, rank, marks = context.get_world_size(), context.get_world_rank(), Path(config["marks"])
    start = lockstep.get_checkpoint()
    step = int(Path(start.path, "step").read_text()) + 1 if start else 0
    while step < 6:
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step").write_text(str(step))
            lockstep.report({"step": step, "world": world}, checkpoint=Checkpoint.from_directory(folder))
        if world == 2 and step == 1 and not (marks / "lost").exists():
            if rank == 1:
                (marks / "rank1.pid").write_text(str(os.getpid()))
            threading.Event().wait()
        if world == 1 and step == 3:
            (marks / "shrunk").write_text("")
            wait_for(marks / "back")
        step += 1


@pytest.mark.timeout(240)
def test_an_elastic_run_shrinks_when_a_worker_is_lost_and_grows_back(storage_path: str, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    outcome: dict[str, Any] = {}
    all_cpus = os.sched_getaffinity(0)

    def fit() -> None:
        outcome["thread"] = threading.get_native_id()
        try:
            outcome["result"] = TorchTrainer(
                shrink_then_grow,
                train_loop_config={"marks": str(marks)},
                scaling_config=ScalingConfig(num_workers=(1, 2)),
                run_config=RunConfig(
                    name="elastic", storage_path=storage_path, failure_config=FailureConfig(max_failures=1)
                ),
            ).fit()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    driver = threading.Thread(target=fit)
    driver.start()
    try:
        wait_for(marks / "rank1.pid")
        os.sched_setaffinity(outcome["thread"], {min(all_cpus)})  # one CPU left: room for one worker
        (marks / "lost").write_text("")
        os.kill(int((marks / "rank1.pid").read_text()), signal.SIGKILL)
        wait_for(marks / "shrunk")
        os.sched_setaffinity(outcome["thread"], all_cpus)
        (marks / "back").write_text("")
        driver.join(180)
    finally:
        if driver.is_alive():
            os.sched_setaffinity(outcome["thread"], all_cpus)
    assert not driver.is_alive()
    result = outcome.get("result")
    assert result is not None, outcome.get("error")
    assert [(row["step"], row["world"]) for row in result.metrics_history] == [
        (0, 2),
        (1, 2),
        (2, 1),
        (3, 1),
        (4, 1),
        (5, 2),
    ]
    assert result.num_failures == 1


def test_an_elastic_run_needs_its_minimum(storage_path: str) -> None:
    cpus = len(os.sched_getaffinity(0))
    with pytest.raises(TrainingFailedError, match=rf"hold {cpus} worker\(s\) now, fewer than the {cpus + 1}"):
        TorchTrainer(
            lambda: None,
            scaling_config=ScalingConfig(num_workers=(cpus + 1, cpus + 2)),
            run_config=RunConfig(storage_path=storage_path),
        ).fit()


def test_num_workers_pairs_are_validated() -> None:
    with pytest.raises(ValueError, match=r"1 <= min <= max, got \(3, 2\)"):
        ScalingConfig(num_workers=(3, 2))
    scaling = ScalingConfig(num_workers=(1, 4))
    assert (scaling.min_workers, scaling.max_workers, scaling.elastic) == (1, 4, True)
    assert not ScalingConfig(num_workers=2).elastic
