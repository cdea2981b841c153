"""The controller's logic with a scripted worker group: no processes, so each rule is checked in
milliseconds (the other test modules run the same rules with real workers). The tests go by the
attempt's three jobs: the report barrier, checkpoint commits, worker liveness and restarts; then
the listeners that hear about all of it."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from lockstep._internal.output.listeners import Listeners
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.run.checkpoint_commits import CheckpointCommits
from lockstep._internal.run.controller import Controller
from lockstep._internal.run.failures import AttemptOutcome, FailureKind
from lockstep._internal.run.liveness import Liveness, RestartPolicy
from lockstep._internal.run.report_barrier import ReportBarrier
from lockstep._internal.run.run_record import RunRecorder
from lockstep._internal.run.worker_group import GroupFactory, WorkerExited, WorkerGroup
from lockstep._internal.wire import protocol
from lockstep.callbacks import AttemptStart, Callback, RunInfo
from lockstep.checkpoint import Checkpoint
from lockstep.config import CheckpointConfig
from lockstep.errors import TrainingFailedError, WorkerFailure


class ScriptedGroup(WorkerGroup):
    """Hands the controller pre-written batches of events, one batch per wait; records what the
    controller sends."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self.batches = list(batches)
        self.sent: list[tuple[int, Any]] = []
        self.timeouts: list[float | None] = []
        self.stacks_asked: list[int] | None = None
        self.stopped = False

    def start(self) -> None:
        pass

    def told(self, kind: type) -> list[tuple[int, Any]]:
        """What the controller sent of one kind, by rank."""
        return [(rank, message) for rank, message in self.sent if isinstance(message, kind)]

    def wait_events(self, timeout: float | None) -> list[Any]:
        assert self.batches, "the controller waited for more events than the script has"
        self.timeouts.append(timeout)
        return self.batches.pop(0)

    def output_tail(self, rank: int) -> str:
        return f"last words of rank {rank}"

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        self.stacks_asked = ranks
        return {rank: f"stack of rank {rank}" for rank in ranks}

    def send(self, rank: int, message: Any) -> None:
        self.sent.append((rank, message))

    def stop(self) -> None:
        self.stopped = True


def report(
    rank: int, index: int, checkpoint: str | None = None, state: str = "written", **metrics: Any
) -> protocol.Report:
    return protocol.Report(
        rank, index, json.dumps(metrics) if rank == 0 else None, checkpoint, state if checkpoint else None
    )


def reports(index: int, checkpoint: str | None = None, state: str = "written", **metrics: Any) -> list[Any]:
    """Report ``index`` from both ranks of a 2-worker group."""
    return [report(0, index, checkpoint, state, **metrics), report(1, index, checkpoint, state)]


def uploaded(rank: int, index: int, error: str | None = None) -> protocol.CheckpointUploaded:
    return protocol.CheckpointUploaded(rank, index, f"checkpoint_{index:06d}", error)


def ended(*ranks: int) -> list[Any]:
    return [event for rank in ranks for event in (protocol.Finished(rank, None), WorkerExited(rank, 0))]


def hello(*ranks: int) -> list[Any]:
    return [protocol.Hello(rank, 1000 + rank) for rank in ranks]


def checkpoint_folders(tmp_path: Path, *indexes: int) -> None:
    for index in indexes:
        Path(tmp_path, "run", f"checkpoint_{index:06d}").mkdir(parents=True)


def controller_for(
    tmp_path: Path,
    groups: list[ScriptedGroup],
    max_failures: int = 0,
    capacity: list[int] | None = None,
    sizes: tuple[int, int] = (2, 2),
    report_timeout_s: float | None = None,
    callbacks: list[Callback] | None = None,
    has_resume_checkpoint: bool = False,
) -> tuple[Controller, list[int]]:
    storage = RunStorage.for_run(str(tmp_path), "run")
    recorder = RunRecorder(storage, CheckpointConfig(), sizes[1])
    recorder.open()
    started_sizes: list[int] = []

    def start_group(size: int) -> WorkerGroup:
        started_sizes.append(size)
        return groups[len(started_sizes) - 1]

    capacities = list(capacity or [])
    factory = GroupFactory(
        "scripted", start_group, sizes[0], sizes[1], (lambda: capacities.pop(0)) if capacity else None
    )
    listeners = Listeners(RunInfo("run", str(tmp_path / "run"), sizes[1], str(tmp_path)), callbacks or [])
    controller = Controller(factory, recorder, max_failures, has_resume_checkpoint, report_timeout_s, listeners)
    return controller, started_sizes


# -- the report barrier ----------------------------------------------------------------------------


def test_report_is_answered_only_when_every_rank_made_it(tmp_path: Path) -> None:
    group = ScriptedGroup([hello(0, 1), [report(0, 0, loss=1.0)], [report(1, 0)], ended(0, 1)])
    controller, _ = controller_for(tmp_path, [group])
    result = controller.run()
    assert [(rank, type(message).__name__) for rank, message in group.sent] == [
        (0, "Start"),
        (1, "Start"),
        (0, "ReportDone"),
        (1, "ReportDone"),
    ]
    assert result.metrics == {"loss": 1.0} and group.stopped


def test_rank_0s_return_value_is_the_results(tmp_path: Path) -> None:
    group = ScriptedGroup(
        [
            hello(0, 1),
            reports(0, loss=1.0),
            [protocol.Finished(0, cloudpickle.dumps({"best": 3})), WorkerExited(0, 0), *ended(1)],
        ]
    )
    controller, _ = controller_for(tmp_path, [group])
    assert controller.run().return_value == {"best": 3}


def test_a_rank_that_returns_while_others_wait_fails_the_run_at_once(tmp_path: Path) -> None:
    group = ScriptedGroup([hello(0, 1), [report(0, 0, loss=1.0), protocol.Finished(1, None)]])
    controller, _ = controller_for(tmp_path, [group])
    with pytest.raises(
        TrainingFailedError, match=r"rank 1: ReportMismatch: returned from the train function after 0 report"
    ):
        controller.run()


def test_a_rank_late_for_a_report_fails_after_the_timeout_and_its_stack_is_shown(tmp_path: Path) -> None:
    group = ScriptedGroup([hello(0, 1), [report(0, 0, loss=1.0)]])
    controller, _ = controller_for(tmp_path, [group], report_timeout_s=0.0)
    with pytest.raises(TrainingFailedError) as raised:
        controller.run()
    assert raised.value.failures[1].error_type == FailureKind.REPORT_TIMEOUT == "ReportTimeout"
    assert "did not call report #0 within 0 s while rank(s) 0 waited in it" in str(raised.value)
    assert group.stacks_asked == [0, 1], "a rank that timed out is stuck, not gone: its stack is wanted too"
    assert "rank 1 was still running, here:\nstack of rank 1" in str(raised.value)


def test_the_group_is_waited_on_until_the_report_deadline_only_while_a_report_waits(tmp_path: Path) -> None:
    group = ScriptedGroup([hello(0, 1), [report(0, 0, loss=1.0)], [report(1, 0)], ended(0, 1)])
    controller, _ = controller_for(tmp_path, [group], report_timeout_s=30.0)
    controller.run()
    before, waiting, after = group.timeouts[:2], group.timeouts[2], group.timeouts[3:]
    assert before == [None, None] and after == [None], "no report waits, no deadline"
    assert waiting is not None and 29.0 < waiting <= 30.0, "rank 0 waits in report #0"


def test_ranks_naming_different_checkpoint_folders_fail_the_run(tmp_path: Path) -> None:
    group = ScriptedGroup([hello(0, 1), [report(0, 0, "checkpoint_a", loss=1.0), report(1, 0, "checkpoint_b")]])
    controller, _ = controller_for(tmp_path, [group])
    with pytest.raises(
        TrainingFailedError, match=r"different checkpoint_dir_name values \['checkpoint_a', 'checkpoint_b'\]"
    ):
        controller.run()
    assert group.stopped


def test_report_barrier_releases_an_index_once_and_tells_who_is_left_behind() -> None:
    barrier = ReportBarrier(world_size=3, timeout_s=None)
    assert barrier.arrive(report(0, 0, loss=1.0)) is None and barrier.arrive(report(2, 0)) is None
    assert barrier.left_behind(finished=set()) == [] and barrier.overdue() == []
    assert barrier.time_to_deadline() is None, "no timeout, no deadline"
    [mismatch] = barrier.left_behind(finished={1})
    assert (mismatch.rank, mismatch.error_type) == (
        1,
        "ReportMismatch",
    ) and "after 0 report() calls" in mismatch.message
    assert sorted(barrier.arrive(report(1, 0)) or {}) == [0, 1, 2]
    assert barrier.waiting == {} and barrier.left_behind(finished={1}) == []


# -- checkpoint commits ------------------------------------------------------------------------------


class Recorder(Callback):
    """Every hook call, by name and its arguments (checkpoints by folder name)."""

    def __init__(self, group: ScriptedGroup | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.group = group

    def on_run_start(self, run: RunInfo) -> None:
        self.calls.append(("on_run_start",))

    def on_attempt_start(self, run: RunInfo, attempt: AttemptStart) -> None:
        name = Path(attempt.checkpoint.path).name if attempt.checkpoint else None
        self.calls.append(
            ("on_attempt_start", attempt.number, attempt.world_size, attempt.reason, name, attempt.failures)
        )

    def on_workers_changed(self, run: RunInfo, alive: int) -> None:
        self.calls.append(("on_workers_changed", alive))

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("after_report", index))

    def on_checkpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
        left = len(self.group.batches) if self.group else None
        self.calls.append(("on_checkpoint", index, Path(checkpoint.path).name, left))

    def on_failure(self, run: RunInfo, error: Exception, restarting: bool) -> None:
        self.calls.append(("on_failure", restarting))

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        self.calls.append(("on_run_end", status))

    def named(self, *hooks: str) -> list[tuple[Any, ...]]:
        return [call for call in self.calls if call[0] in hooks]


def test_async_uploads_are_committed_in_report_order_once_every_rank_uploaded(tmp_path: Path) -> None:
    checkpoint_folders(tmp_path, 0, 1)
    group = ScriptedGroup(
        [
            hello(0, 1),
            reports(0, "checkpoint_000000", "uploading", loss=1.0),
            reports(1, "checkpoint_000001", "uploading", loss=0.5),
            [uploaded(0, 1), uploaded(1, 1)],
            [uploaded(0, 0)],
            [uploaded(1, 0)],
            ended(0, 1),
        ]
    )
    recorder = Recorder(group)
    controller, _ = controller_for(tmp_path, [group], callbacks=[recorder])
    result = controller.run()
    assert recorder.named("after_report", "on_checkpoint") == [
        ("after_report", 0),
        ("after_report", 1),
        ("on_checkpoint", 0, "checkpoint_000000", 1),
        ("on_checkpoint", 1, "checkpoint_000001", 1),
    ], "report 1's upload ended first, but its commit waits for report 0's (both at the last upload)"
    assert Path(result.checkpoint.path).name == "checkpoint_000001"


def test_an_upload_that_ends_before_the_report_completes_is_not_waited_for(tmp_path: Path) -> None:
    checkpoint_folders(tmp_path, 0)
    group = ScriptedGroup(
        [
            hello(0, 1),
            [report(0, 0, "checkpoint_000000", "uploading", loss=1.0), uploaded(0, 0)],
            [report(1, 0, "checkpoint_000000")],
            ended(0, 1),
        ]
    )
    controller, _ = controller_for(tmp_path, [group])
    controller.run()
    [(_, done), _] = group.told(protocol.ReportDone)
    assert done.new_latest_checkpoint is not None, "committed at once, so the ranks hear of it with the report"
    assert done.new_latest_checkpoint.dir_name == "checkpoint_000000"


def test_a_failed_upload_fails_the_rank_and_its_folder_is_discarded(tmp_path: Path) -> None:
    checkpoint_folders(tmp_path, 0)
    group = ScriptedGroup(
        [
            hello(0, 1),
            [
                protocol.WritingCheckpoint(0, "checkpoint_000000"),
                *reports(0, "checkpoint_000000", "uploading", loss=1.0),
            ],
            [uploaded(0, 0, error="disk full")],
        ]
    )
    controller, _ = controller_for(tmp_path, [group])
    with pytest.raises(TrainingFailedError, match="rank 0: CheckpointUploadError: disk full"):
        controller.run()
    assert not Path(tmp_path, "run", "checkpoint_000000").exists(), "an uncommitted folder of a failed attempt stays"


def test_checkpoint_commits_hand_out_only_what_every_rank_uploaded() -> None:
    commits = CheckpointCommits()
    assert commits.uploaded(uploaded(1, 0)) is None and commits.uploaded_early == {(0, 1)}
    commits.reported(0, "checkpoint_000000", {"loss": 1.0}, reports(0, "checkpoint_000000", "uploading"))
    assert commits.pending[0].waiting == {0}, "rank 1 uploaded early"
    assert list(commits.ready()) == []
    commits.uploaded(uploaded(0, 0))
    assert [(index, pending.dir_name) for index, pending in commits.ready()] == [(0, "checkpoint_000000")]
    assert commits.pending == {}
    failure = commits.uploaded(uploaded(1, 1, error="no space"))
    assert failure is not None and failure.error_type == "CheckpointUploadError"


# -- worker liveness and restarts --------------------------------------------------------------------


def test_a_silent_exit_is_a_failure_and_the_group_restarts_from_the_checkpoint(tmp_path: Path) -> None:
    Path(tmp_path, "run", "checkpoint_000000").mkdir(parents=True)
    first = ScriptedGroup(
        [
            hello(0, 1),
            [report(0, 0, "checkpoint_000000", loss=1.0), report(1, 0, "checkpoint_000000")],
            [WorkerExited(1, -9, "its Ray actor died: node lost")],
        ]
    )
    second = ScriptedGroup([hello(0, 1), [report(0, 1, loss=0.5), report(1, 1)], ended(0, 1)])
    controller, sizes = controller_for(tmp_path, [first, second], max_failures=1)
    result = controller.run()
    assert sizes == [2, 2] and result.num_failures == 1
    assert result.checkpoint.path.endswith("checkpoint_000000") and result.metrics == {"loss": 0.5}
    [(_, start), _] = second.told(protocol.Start)
    assert (start.first_report_index, start.checkpoint.dir_name, start.used_dir_names) == (
        1,
        "checkpoint_000000",
        ["checkpoint_000000"],
    )
    assert "rank 1: WorkerDied: its Ray actor died: node lost" in str(controller.failure_history[0])


def test_an_elastic_group_grows_right_after_a_checkpoint_when_more_fit(tmp_path: Path) -> None:
    Path(tmp_path, "run", "checkpoint_000000").mkdir(parents=True)
    small = ScriptedGroup([hello(0), [report(0, 0, "checkpoint_000000", loss=1.0)]])
    large = ScriptedGroup([hello(0, 1), [report(0, 1, loss=0.5), report(1, 1)], ended(0, 1)])
    controller, sizes = controller_for(tmp_path, [small, large], capacity=[1, 2, 2], sizes=(1, 2))
    result = controller.run()
    assert sizes == [1, 2] and result.num_failures == 0 and small.stopped
    assert [row["loss"] for row in result.metrics_history] == [1.0, 0.5]


def test_each_rank_is_told_where_the_attempt_starts_when_it_says_hello(tmp_path: Path) -> None:
    group = ScriptedGroup([hello(1), hello(0), reports(0, loss=1.0), ended(0, 1)])
    controller, _ = controller_for(tmp_path, [group], has_resume_checkpoint=True)
    controller.run()
    assert [rank for rank, _ in group.told(protocol.Start)] == [1, 0]
    [(_, start), _] = group.told(protocol.Start)
    assert start == protocol.Start(0, None, from_resume_checkpoint=True, used_dir_names=[])


def test_a_failure_beyond_max_failures_ends_the_run_with_every_failure(tmp_path: Path) -> None:
    failing = [
        ScriptedGroup([hello(0, 1), [protocol.Failed(WorkerFailure(0, "ValueError", f"bad {n}"))]]) for n in (1, 2)
    ]
    controller, sizes = controller_for(tmp_path, failing, max_failures=1)
    with pytest.raises(TrainingFailedError) as raised:
        controller.run()
    assert sizes == [2, 2] and "Training failed 2 times (max_failures=1)" in str(raised.value)
    assert "Failure 1: " in str(raised.value) and "rank 0: ValueError: bad 2" in str(raised.value)
    assert raised.value.failures[0].error_type == "ValueError", "a user exception keeps its own type name"
    assert failing[0].stacks_asked == [1], "the rank that failed on its own has no stack to show"


def test_max_failures_minus_one_restarts_for_ever(tmp_path: Path) -> None:
    groups = [ScriptedGroup([hello(0, 1), [WorkerExited(1, 1)]]) for _ in range(3)]
    groups.append(ScriptedGroup([hello(0, 1), reports(0, loss=1.0), ended(0, 1)]))
    controller, sizes = controller_for(tmp_path, groups, max_failures=-1)
    result = controller.run()
    assert len(sizes) == 4 and result.num_failures == 3
    assert (
        "rank 1: WorkerDied: the worker process exited with code 1 before its train function returned\n"
        "last words of rank 1" in str(controller.failure_history[0])
    )


def test_liveness_outcome_a_failure_wins_over_success_and_growth() -> None:
    liveness = Liveness(world_size=2)
    for rank in (0, 1):
        liveness.hello(rank)
        liveness.finish(rank)
    assert liveness.alive == 2 and liveness.outcome is None
    liveness.exit(WorkerExited(0, 0), lambda rank: "")
    liveness.grow_if(lambda size: size < 4)
    assert liveness.alive == 1 and liveness.outcome is AttemptOutcome.GROW
    liveness.exit(WorkerExited(1, 0), lambda rank: "")
    assert liveness.failures == [] and liveness.outcome is AttemptOutcome.SUCCEEDED
    liveness.fail([FailureKind.WORKER_DIED.failure(1, "gone")])
    assert liveness.outcome is AttemptOutcome.FAILED


def test_restart_policy_counts_failures_against_max_failures() -> None:
    policy = RestartPolicy(max_failures=1)
    first, second = TrainingFailedError("one"), TrainingFailedError("two")
    assert policy.record(first) is True and policy.final_error(first) is first
    assert policy.record(second) is False and "Failure 2: two" in str(policy.final_error(second))
    assert RestartPolicy(max_failures=-1).record(first) is True


def test_a_failure_kind_is_a_plain_string_in_a_worker_failure() -> None:
    failure = FailureKind.REPORT_MISMATCH.failure(3, "returned early")
    assert type(failure.error_type) is str and failure.error_type == FailureKind.REPORT_MISMATCH
    assert pickle.loads(pickle.dumps(failure)) == failure and str(FailureKind.WORKER_DIED) == "WorkerDied"


# -- listeners ---------------------------------------------------------------------------------------


def test_every_callback_hook_is_called_through_growth_a_failure_and_a_restart(tmp_path: Path) -> None:
    checkpoint_folders(tmp_path, 0, 1)
    small = ScriptedGroup([hello(0), [report(0, 0, "checkpoint_000000", loss=1.0)]])
    failing = ScriptedGroup([hello(0, 1), reports(1, "checkpoint_000001", loss=0.5), [WorkerExited(1, -9)]])
    last = ScriptedGroup([hello(0, 1), reports(2, loss=0.25), ended(0, 1)])
    recorder = Recorder()
    controller, sizes = controller_for(
        tmp_path, [small, failing, last], max_failures=1, capacity=[1, 2, 2, 2, 2], sizes=(1, 2), callbacks=[recorder]
    )
    controller.run()
    assert sizes == [1, 2, 2]
    assert recorder.named("on_run_start", "on_attempt_start", "on_failure", "on_run_end") == [
        ("on_run_start",),
        ("on_attempt_start", 1, 1, "start", None, 0),
        ("on_attempt_start", 2, 2, "grow", "checkpoint_000000", 0),
        ("on_failure", True),
        ("on_attempt_start", 3, 2, "restart", "checkpoint_000001", 1),
        ("on_run_end", "finished"),
    ]
    assert recorder.named("after_report") == [("after_report", 0), ("after_report", 1), ("after_report", 2)]
    assert [call[1] for call in recorder.named("on_workers_changed")][:3] == [1, 1, 2]
    hooks = {name for name in vars(Callback) if name.startswith(("on_", "after_"))}
    assert {call[0] for call in recorder.calls} == hooks, "every hook of Callback must reach a callback"
