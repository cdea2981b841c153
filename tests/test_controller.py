"""The controller's logic with a scripted worker group: no processes, so each rule is checked in
milliseconds (the other test modules run the same rules with real workers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lockstep._internal import protocol
from lockstep._internal.controller import Controller
from lockstep._internal.executors import GroupFactory
from lockstep._internal.executors.base import WorkerExited, WorkerGroup
from lockstep._internal.run_record import RunRecorder
from lockstep._internal.storage import RunStorage
from lockstep.config import CheckpointConfig
from lockstep.errors import TrainingFailedError


class ScriptedGroup(WorkerGroup):
    """Hands the controller pre-written batches of events, one batch per wait; records what the
    controller sends."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self.batches = list(batches)
        self.sent: list[tuple[int, Any]] = []
        self.stopped = False

    def start(self, payload: bytes) -> None:
        pass

    def wait_events(self, timeout: float | None) -> list[Any]:
        assert self.batches, "the controller waited for more events than the script has"
        return self.batches.pop(0)

    def send(self, rank: int, message: Any) -> None:
        self.sent.append((rank, message))

    def stop(self) -> None:
        self.stopped = True


def report(rank: int, index: int, checkpoint: str | None = None, **metrics: Any) -> protocol.Report:
    return protocol.Report(rank, index, json.dumps(metrics) if rank == 0 else None, checkpoint,
                           "written" if checkpoint else None)


def ended(*ranks: int) -> list[Any]:
    return [event for rank in ranks for event in (protocol.Finished(rank, None), WorkerExited(rank, 0))]


def hello(*ranks: int) -> list[Any]:
    return [protocol.Hello(rank, 1000 + rank) for rank in ranks]


def controller_for(tmp_path: Path, groups: list[ScriptedGroup], max_failures: int = 0,
                   capacity: list[int] | None = None, sizes: tuple[int, int] = (2, 2)) -> tuple[Controller, list[int]]:
    storage = RunStorage.for_run(str(tmp_path), "run")
    recorder = RunRecorder(storage, CheckpointConfig(), sizes[1])
    recorder.open()
    started_sizes: list[int] = []

    def start_group(size: int) -> WorkerGroup:
        started_sizes.append(size)
        return groups[len(started_sizes) - 1]

    capacities = list(capacity or [])
    factory = GroupFactory("scripted", start_group, sizes[0], sizes[1], (lambda: capacities.pop(0)) if capacity else None)
    return Controller(factory, lambda index, checkpoint: b"", recorder, max_failures), started_sizes


def test_report_is_answered_only_when_every_rank_made_it(tmp_path: Path) -> None:
    group = ScriptedGroup([hello(0, 1), [report(0, 0, loss=1.0)], [report(1, 0)], ended(0, 1)])
    controller, _ = controller_for(tmp_path, [group])
    result = controller.run(b"")
    assert [(rank, type(message).__name__) for rank, message in group.sent] == [(0, "ReportDone"), (1, "ReportDone")]
    assert result.metrics == {"loss": 1.0} and group.stopped


def test_a_rank_that_returns_while_others_wait_fails_the_run_at_once(tmp_path: Path) -> None:
    group = ScriptedGroup([hello(0, 1), [report(0, 0, loss=1.0), protocol.Finished(1, None)]])
    controller, _ = controller_for(tmp_path, [group])
    with pytest.raises(TrainingFailedError, match=r"rank 1: ReportMismatch: returned from the train function after 0 report"):
        controller.run(b"")


def test_a_silent_exit_is_a_failure_and_the_group_restarts_from_the_checkpoint(tmp_path: Path) -> None:
    Path(tmp_path, "run", "checkpoint_000000").mkdir(parents=True)
    first = ScriptedGroup([hello(0, 1), [report(0, 0, "checkpoint_000000", loss=1.0), report(1, 0, "checkpoint_000000")],
                           [WorkerExited(1, -9, "its Ray actor died: node lost")]])
    second = ScriptedGroup([hello(0, 1), [report(0, 1, loss=0.5), report(1, 1)], ended(0, 1)])
    controller, sizes = controller_for(tmp_path, [first, second], max_failures=1)
    result = controller.run(b"")
    assert sizes == [2, 2] and result.num_failures == 1
    assert result.checkpoint.path.endswith("checkpoint_000000") and result.metrics == {"loss": 0.5}
    assert "rank 1: WorkerDied: its Ray actor died: node lost" in str(controller.failure_history[0])


def test_an_elastic_group_grows_right_after_a_checkpoint_when_more_fit(tmp_path: Path) -> None:
    Path(tmp_path, "run", "checkpoint_000000").mkdir(parents=True)
    small = ScriptedGroup([hello(0), [report(0, 0, "checkpoint_000000", loss=1.0)]])
    large = ScriptedGroup([hello(0, 1), [report(0, 1, loss=0.5), report(1, 1)], ended(0, 1)])
    controller, sizes = controller_for(tmp_path, [small, large], capacity=[1, 2, 2], sizes=(1, 2))
    result = controller.run(b"")
    assert sizes == [1, 2] and result.num_failures == 0 and small.stopped
    assert [row["loss"] for row in result.metrics_history] == [1.0, 0.5]
