"""The controller: runs the worker group, turns the workers' reports into committed reports,
and decides what a failure means (restart from the latest checkpoint, or give up).

A run is a sequence of attempts. Each attempt starts a fresh worker group and ends when every
rank has finished (success) or one has failed. ``report()`` calls are collected per report
index; when the last rank's call arrives the report is committed and every rank is released.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle

from lockstep._internal import protocol
from lockstep._internal.executors import GroupFactory
from lockstep._internal.executors.base import WorkerExited, WorkerGroup
from lockstep._internal.metrics_text import metrics_text
from lockstep._internal.progress import ProgressLine
from lockstep._internal.run_record import RunRecorder
from lockstep.callbacks import CallbackRunner
from lockstep.checkpoint import Checkpoint
from lockstep.errors import TrainingFailedError, WorkerFailure
from lockstep.result import Result

logger = logging.getLogger(__name__)

PayloadBuilder = Callable[[int, Checkpoint | None], bytes]


@dataclass
class Attempt:
    """What the controller knows about the current worker group."""

    world_size: int
    started_at: float = field(default_factory=time.monotonic)
    connected: set[int] = field(default_factory=set)
    pending_reports: dict[int, dict[int, protocol.Report]] = field(default_factory=dict)
    reports_made: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    exited: set[int] = field(default_factory=set)
    failures: list[WorkerFailure] = field(default_factory=list)
    uploads: dict[int, "PendingCheckpoint"] = field(default_factory=dict)
    uploaded_early: set[tuple[int, int]] = field(default_factory=set)
    written_dir_names: set[str] = field(default_factory=set)
    report_waiting_since: dict[int, float] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    latest_sent: Checkpoint | None = None
    return_value: Any = None
    grow: bool = False

    @property
    def succeeded(self) -> bool:
        return len(self.exited) == self.world_size and len(self.finished) == self.world_size

    @property
    def over(self) -> bool:
        return bool(self.failures) or self.succeeded or self.grow


@dataclass
class PendingCheckpoint:
    """A reported checkpoint whose ASYNC uploads are still running on ``waiting`` ranks."""

    dir_name: str
    metrics: dict[str, Any]
    waiting: set[int]
    external_path: str | None = None


class Controller:
    """Drives one run to a Result or a TrainingFailedError."""

    def __init__(
        self,
        make_group: GroupFactory,
        build_payload: PayloadBuilder,
        recorder: RunRecorder,
        max_failures: int,
        start_checkpoint: Checkpoint | None = None,
        report_timeout_s: float | None = None,
        progress: ProgressLine | None = None,
        callbacks: CallbackRunner | None = None,
    ) -> None:
        self.make_group = make_group
        self.build_payload = build_payload
        self.recorder = recorder
        self.max_failures = max_failures
        self.start_checkpoint = start_checkpoint
        self.report_timeout_s = report_timeout_s
        self.progress = progress
        self.callbacks = callbacks
        self.failure_history: list[TrainingFailedError] = []

    def run(self, first_payload: bytes) -> Result:
        """Run attempts until one succeeds or failures exceed ``max_failures``."""
        payload = first_payload
        self._callback("on_run_start")
        try:
            while True:
                attempt = self._run_attempt(payload)
                if attempt.succeeded:
                    assert not attempt.uploads, f"uploads still pending after every rank finished: {attempt.uploads}"
                    self._finish("finished")
                    return self.recorder.result(attempt.return_value)
                if attempt.grow and not attempt.failures:
                    logger.warning("More than %d workers fit now: restarting with more, from %s.",
                                   attempt.world_size, self.recorder.latest_checkpoint)
                    payload = self.build_payload(self.recorder.next_report_index, self._resume_checkpoint())
                    continue
                error = TrainingFailedError.from_failures(attempt.failures, self._failure_context(), attempt.stacks)
                self.failure_history.append(error)
                self.recorder.count_failure()
                self._callback("on_failure", error, self._may_restart())
                if not self._may_restart():
                    raise self._final_error(error)
                logger.warning("%s\nRestarting the workers (failure %d of %s allowed).", error,
                               len(self.failure_history), self._allowed())
                if self.progress is not None:
                    self.progress.on_restart()
                payload = self.build_payload(self.recorder.next_report_index, self._resume_checkpoint())
        except KeyboardInterrupt:
            self._finish("interrupted", TrainingFailedError("The run was interrupted (Ctrl-C)."))
            raise
        except TrainingFailedError as error:
            self._finish("failed", error)
            raise
        except Exception as error:
            failure = TrainingFailedError(
                f"The driver could not go on: {type(error).__name__}: {error} "
                f"(report #{self.recorder.next_report_index} was next)."
            )
            self._finish("failed", failure)
            raise failure from error

    def _finish(self, status: str, error: TrainingFailedError | None = None) -> None:
        """Record how the run ended, and leave the progress line's last state on screen."""
        if self.progress is not None:
            self.progress.finish(status)
        self.recorder.finish(status, error)
        self._callback("on_run_end", status, error)

    def _callback(self, hook: str, *args: Any) -> None:
        if self.callbacks is not None:
            self.callbacks.call(hook, *args)

    def _workers_changed(self, attempt: Attempt) -> None:
        if self.progress is not None:
            self.progress.on_workers(len(attempt.connected - attempt.exited))

    def _resume_checkpoint(self) -> Checkpoint | None:
        return self.recorder.latest_checkpoint or self.start_checkpoint

    def _failure_context(self) -> str:
        return f" (report #{self.recorder.next_report_index} was next)"

    def _allowed(self) -> str:
        return "unlimited" if self.max_failures < 0 else str(self.max_failures)

    def _may_restart(self) -> bool:
        return self.max_failures < 0 or len(self.failure_history) <= self.max_failures

    def _final_error(self, error: TrainingFailedError) -> TrainingFailedError:
        if len(self.failure_history) == 1:
            return error
        lines = [f"Training failed {len(self.failure_history)} times (max_failures={self.max_failures})."]
        lines += [f"Failure {number}: {failure}" for number, failure in enumerate(self.failure_history, 1)]
        return TrainingFailedError("\n\n".join(lines), error.failures)

    # -- one attempt --------------------------------------------------------------------------

    def _run_attempt(self, payload: bytes) -> Attempt:
        size = self.make_group.size_now()
        self.recorder.set_world_size(size)
        if self.progress is not None:
            self.progress.world_size = size
        attempt = Attempt(size, latest_sent=self._resume_checkpoint())
        group = self.make_group(size)
        try:
            group.start(payload)
            while not attempt.over:
                events = group.wait_events(self._time_to_report_deadline(attempt))
                for event in events:
                    self._handle(event, attempt, group)
                self._check_report_deadline(attempt)
            if attempt.failures:
                attempt.stacks = group.dump_stacks(self._ranks_still_running(attempt))
        finally:
            group.stop()
        if not attempt.succeeded:
            self.recorder.discard_uncommitted(attempt.written_dir_names)
        return attempt

    def _handle(self, event: Any, attempt: Attempt, group: WorkerGroup) -> None:
        if isinstance(event, protocol.Report):
            self._on_report(event, attempt, group)
        elif isinstance(event, protocol.CheckpointUploaded):
            self._on_uploaded(event, attempt)
        elif isinstance(event, protocol.WritingCheckpoint):
            attempt.written_dir_names.add(event.dir_name)
        elif isinstance(event, protocol.Hello):
            self._on_hello(event, attempt)
        elif isinstance(event, protocol.Finished):
            self._on_finished(event, attempt)
        elif isinstance(event, protocol.Failed):
            attempt.failures.append(event.failure)
        elif isinstance(event, WorkerExited):
            self._on_exit(event, attempt, group)

    def _on_hello(self, hello: protocol.Hello, attempt: Attempt) -> None:
        attempt.connected.add(hello.rank)
        self._workers_changed(attempt)
        if len(attempt.connected) == attempt.world_size:
            logger.debug("%d workers connected in %.2f s.", attempt.world_size, time.monotonic() - attempt.started_at)

    def _time_to_report_deadline(self, attempt: Attempt) -> float | None:
        if self.report_timeout_s is None or not attempt.report_waiting_since:
            return None
        oldest = min(attempt.report_waiting_since.values())
        return max(0.0, oldest + self.report_timeout_s - time.monotonic())

    def _check_report_deadline(self, attempt: Attempt) -> None:
        """Fail ranks that left others waiting in report() for longer than the timeout."""
        if self.report_timeout_s is None or attempt.failures:
            return
        for index, since in attempt.report_waiting_since.items():
            if time.monotonic() - since < self.report_timeout_s:
                continue
            calls = attempt.pending_reports[index]
            waiting = ", ".join(str(rank) for rank in sorted(calls))
            attempt.failures += [
                WorkerFailure(rank, "ReportTimeout",
                              f"did not call report #{index} within {self.report_timeout_s:g} s while rank(s) "
                              f"{waiting} waited in it (FailureConfig.report_timeout_s).")
                for rank in range(attempt.world_size) if rank not in calls
            ]
            return

    def _ranks_still_running(self, attempt: Attempt) -> list[int]:
        failed = {failure.rank for failure in attempt.failures if failure.error_type != "ReportTimeout"}
        return [rank for rank in range(attempt.world_size) if rank not in attempt.exited and rank not in failed]

    def _on_report(self, report: protocol.Report, attempt: Attempt, group: WorkerGroup) -> None:
        attempt.reports_made[report.rank] = report.index + 1
        calls = attempt.pending_reports.setdefault(report.index, {})
        attempt.report_waiting_since.setdefault(report.index, time.monotonic())
        calls[report.rank] = report
        if len(calls) < attempt.world_size:
            self._check_no_rank_left(attempt)
            return
        del attempt.pending_reports[report.index]
        del attempt.report_waiting_since[report.index]
        self._record(report.index, calls, attempt)
        latest = self.recorder.latest_checkpoint
        changed = latest if latest != attempt.latest_sent else None
        attempt.latest_sent = latest
        done = protocol.ReportDone(report.index, changed)
        for rank in range(attempt.world_size):
            group.send(rank, done)

    def _record(self, index: int, calls: dict[int, protocol.Report], attempt: Attempt) -> None:
        """Log report ``index``; commit its checkpoint now, or once its ASYNC uploads end."""
        with_checkpoint = [call for call in calls.values() if call.checkpoint_dir_name is not None]
        dir_names = sorted({call.checkpoint_dir_name for call in with_checkpoint})
        if len(dir_names) > 1:
            raise TrainingFailedError(
                f"report #{index}: ranks passed different checkpoint_dir_name values {dir_names}; "
                "every rank must use the same name."
            )
        dir_name = dir_names[0] if dir_names else None
        report = self.recorder.log_report(index, calls[0].metrics_json or "{}", dir_name)
        logger.info("report #%d: %s", index, metrics_text(report["metrics"], limit=200))
        if self.progress is not None:
            self.progress.on_report(index, report["metrics"])
        self._callback("after_report", index, report["metrics"])
        if dir_name is None:
            return
        uploading = {
            call.rank for call in with_checkpoint
            if call.checkpoint_state == "uploading" and (index, call.rank) not in attempt.uploaded_early
        }
        external = next((call.external_path for call in with_checkpoint if call.external_path), None)
        attempt.uploads[index] = PendingCheckpoint(dir_name, report["metrics"], uploading, external)
        self._commit_uploaded(attempt)

    def _on_uploaded(self, uploaded: protocol.CheckpointUploaded, attempt: Attempt) -> None:
        if uploaded.error is not None:
            attempt.failures.append(WorkerFailure(uploaded.rank, "CheckpointUploadError", uploaded.error))
            return
        pending = attempt.uploads.get(uploaded.index)
        if pending is None:  # the upload beat the other ranks' report() calls
            attempt.uploaded_early.add((uploaded.index, uploaded.rank))
            return
        pending.waiting.discard(uploaded.rank)
        self._commit_uploaded(attempt)

    def _commit_uploaded(self, attempt: Attempt) -> None:
        """Commit finished checkpoints in report order (a later one waits for an earlier one)."""
        for index in sorted(attempt.uploads):
            pending = attempt.uploads[index]
            if pending.waiting:
                return
            self.recorder.commit_checkpoint(pending.dir_name, index, pending.metrics, pending.external_path)
            logger.info("checkpoint %s committed (report #%d).", pending.dir_name, index)
            if self.progress is not None:
                self.progress.on_checkpoint(pending.dir_name)
            self._callback("on_checkpoint", index, self.recorder.latest_checkpoint)
            attempt.grow = attempt.grow or self.make_group.can_grow(attempt.world_size)
            del attempt.uploads[index]

    def _on_finished(self, finished: protocol.Finished, attempt: Attempt) -> None:
        attempt.finished.add(finished.rank)
        if finished.rank == 0 and finished.return_value is not None:
            attempt.return_value = cloudpickle.loads(finished.return_value)
        self._check_no_rank_left(attempt)

    def _check_no_rank_left(self, attempt: Attempt) -> None:
        """Fail at once when ranks wait in a report() that a finished rank will never make."""
        for index, calls in attempt.pending_reports.items():
            gone = sorted(rank for rank in attempt.finished if rank not in calls)
            if gone:
                waiting = ", ".join(str(rank) for rank in sorted(calls))
                attempt.failures += [
                    WorkerFailure(
                        rank, "ReportMismatch",
                        f"returned from the train function after {attempt.reports_made.get(rank, 0)} "
                        f"report() calls while rank(s) {waiting} wait in report #{index}; every rank must "
                        "call report() the same number of times.",
                    )
                    for rank in gone
                ]
                return

    def _on_exit(self, exited: WorkerExited, attempt: Attempt, group: WorkerGroup) -> None:
        """A process ended; without a Finished or Failed message first, that is a failure, shown
        with the last lines the rank wrote to stderr."""
        attempt.exited.add(exited.rank)
        self._workers_changed(attempt)
        failed_ranks = {failure.rank for failure in attempt.failures}
        if exited.rank not in attempt.finished and exited.rank not in failed_ranks:
            attempt.failures.append(WorkerFailure(
                exited.rank, "WorkerDied", exited.cause or f"the worker process {describe_exit(exited.returncode)}",
                group.output_tail(exited.rank),
            ))


def describe_exit(returncode: int) -> str:
    """How a process ended, in words (with the usual cause of a SIGKILL)."""
    if returncode >= 0:
        return f"exited with code {returncode} before its train function returned"
    name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
    hint = " (often the out-of-memory killer)" if -returncode == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"
