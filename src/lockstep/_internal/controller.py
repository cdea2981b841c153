"""The controller: runs the worker group, turns the workers' reports into committed reports,
and decides what a failure means (restart from the latest checkpoint, or give up).

A run is a sequence of attempts. Each attempt starts a fresh worker group and ends with an
:class:`AttemptOutcome`: every rank finished, one failed, or an elastic run can grow. Its state
is split by job: the :class:`ReportBarrier` (``report()`` is a collective), the
:class:`CheckpointCommits` (committed in report order once uploaded) and the :class:`Liveness`
of its ranks. Whatever happens is told to the run's :class:`Listeners`.

Each rank that says Hello is told where the attempt starts (:class:`protocol.Start`): the next
report index and the run's latest checkpoint, as the run record has them when the group starts.

A preemption notice (see :mod:`lockstep._internal.preemption`) is told to every rank with the
next ReportDone; the run stops as ``preempted`` once a checkpoint is committed after it, when
the grace runs out, or at a second notice, without counting a failure. A stop requested by
``RunConfig(stop=...)`` or a callback (see :mod:`lockstep._internal.stopping`) is told the same
way, and the run ends ``stopped`` (or ``pruned``) once its ranks have left.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal import protocol
from lockstep._internal.checkpoint_commits import CheckpointCommits, agreed_dir_name
from lockstep._internal.checkpoints import best_checkpoints
from lockstep._internal.collectives import CollectiveBarrier
from lockstep._internal.worker_group import GroupFactory, WorkerExited, WorkerGroup
from lockstep._internal.failures import AttemptOutcome
from lockstep._internal.listeners import Listeners
from lockstep._internal.liveness import Liveness, RestartPolicy
from lockstep._internal.preemption import HangUp, Preemption, PreemptionStop
from lockstep._internal.progress import note_slow_rank
from lockstep._internal.report_barrier import ReportBarrier
from lockstep._internal.run_record import RunRecorder
from lockstep._internal.stopping import Stopping
from lockstep._internal.storage import CheckpointEntry
from lockstep._internal.stragglers import slowest_rank, times_record
from lockstep.callbacks import AttemptReason, AttemptStart, RunInfo
from lockstep.config import DEFAULT_PREEMPTION_GRACE_S
from lockstep.errors import ControllerError, PreemptionError, TrainingFailedError, WorkerGroupError
from lockstep.result import Result

logger = logging.getLogger(__name__)


@dataclass
class Attempt:
    """What the controller knows about the current worker group, by job."""

    start: protocol.Start
    barrier: ReportBarrier
    liveness: Liveness
    collectives: CollectiveBarrier
    commits: CheckpointCommits = field(default_factory=CheckpointCommits)
    queries: list[protocol.CheckpointsQuery] = field(default_factory=list)
    latest_sent: CheckpointEntry | None = None
    return_value: Any = None
    stacks: dict[int, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self.liveness.world_size

    @property
    def outcome(self) -> AttemptOutcome | None:
        """How the attempt ended, or ``None`` while it goes on."""
        return self.liveness.outcome


class Controller:
    """Drives one run to a Result or a TrainingFailedError.

    Args:
        make_group: Starts the worker group of each attempt.
        recorder: The run record that reports and checkpoints are committed to.
        max_failures: Failed attempts allowed before the run fails (``-1``: any number).
        has_resume_checkpoint: Whether the ranks start from the trainer's
            ``resume_from_checkpoint`` while the run has no checkpoint of its own.
        report_timeout_s: How long ranks may wait in a ``report()`` for the others.
        listeners: Who hears about the run (log lines, progress line, callbacks); none if omitted.
        preemption: Where preemption notices are kept; one with ``FailureConfig``'s default
            grace if omitted.
    """

    def __init__(
        self,
        make_group: GroupFactory,
        recorder: RunRecorder,
        max_failures: int,
        has_resume_checkpoint: bool = False,
        report_timeout_s: float | None = None,
        listeners: Listeners | None = None,
        preemption: Preemption | None = None,
    ) -> None:
        self.make_group = make_group
        self.recorder = recorder
        self.restart_policy = RestartPolicy(max_failures)
        self.has_resume_checkpoint = has_resume_checkpoint
        self.report_timeout_s = report_timeout_s
        self.preemption = preemption or Preemption(DEFAULT_PREEMPTION_GRACE_S)
        storage = recorder.storage
        listeners = listeners or Listeners(RunInfo(storage.name, storage.display_path, recorder.world_size, ""))
        self.listeners = listeners
        self.stopping = Stopping(listeners.run)

    @property
    def failure_history(self) -> list[TrainingFailedError]:
        """The error of each failed attempt so far."""
        return self.restart_policy.history

    def run(self) -> Result:
        """Run attempts until one succeeds or failures exceed ``max_failures``."""
        self.listeners.on_run_start()
        try:
            result = self._run_attempts()
        except KeyboardInterrupt:
            self._finish("interrupted", TrainingFailedError("The run was interrupted (Ctrl-C)."))
            raise
        except HangUp as hangup:
            self._finish("interrupted", TrainingFailedError(f"The run was interrupted: {hangup}."))
            raise
        except PreemptionStop:
            preempted = self.preemption.error(self._latest_name())
            self._finish("preempted", preempted)
            raise preempted from None
        except PreemptionError as error:
            self._finish("preempted", error)
            raise
        except (WorkerGroupError, ControllerError) as error:
            self._finish("failed", error)
            raise
        except TrainingFailedError as error:
            # the executor or a commit could not go on (placement, storage): the driver's failure
            failure = ControllerError(str(error), error.failures, controller_failure=error)
            self._finish("failed", failure)
            raise failure from error
        except Exception as error:
            failure = ControllerError(
                f"The driver could not go on: {type(error).__name__}: {error} "
                f"(report #{self.recorder.next_report_index} was next).", controller_failure=error,
            )
            self._finish("failed", failure)
            raise failure from error
        except BaseException as error:  # SystemExit & co. (e.g. from a callback): the record must still end
            self._finish("failed", ControllerError(f"The driver stopped: {type(error).__name__}: {error}."))
            raise
        return self.stopping.outcome(result)

    def _run_attempts(self) -> Result:
        number = 1
        reason: AttemptReason = "start"
        while True:
            attempt = self._run_attempt(AttemptStart(
                number, self.make_group.size_now(), reason, self.recorder.latest_checkpoint,
                len(self.failure_history), self.restart_policy.max_failures,
            ))
            if self.stopping.request is not None:
                return self._stopped(attempt)
            if self.preemption.noticed and attempt.outcome is not AttemptOutcome.SUCCEEDED:
                raise self.preemption.error(self._latest_name())
            if attempt.outcome is AttemptOutcome.SUCCEEDED:
                assert not attempt.commits.pending, f"uploads still pending after every rank finished: {attempt.commits.pending}"
                self._finish("finished")
                return self.recorder.result(attempt.return_value)
            if attempt.outcome is AttemptOutcome.FAILED:
                self._fail_or_go_on(attempt)
            number, reason = number + 1, "grow" if attempt.outcome is AttemptOutcome.GROW else "restart"

    def _fail_or_go_on(self, attempt: Attempt) -> None:
        """Count the failed attempt; raise its error unless the policy allows a restart."""
        error = WorkerGroupError.from_failures(attempt.liveness.failures, self._failure_context(), attempt.stacks)
        restarting = self.restart_policy.record(error)
        self.recorder.count_failure()
        self.listeners.on_failure(error, restarting)
        if not restarting:
            raise self.restart_policy.final_error(error)

    def _stopped(self, attempt: Attempt) -> Result:
        """End a run that was asked to stop, once its ranks have left."""
        request = self.stopping.request
        assert request is not None
        if attempt.outcome is AttemptOutcome.FAILED:
            logger.warning("While run %s stopped: %s", self.recorder.storage.name,
                           WorkerGroupError.from_failures(attempt.liveness.failures, self._failure_context()))
        self._finish(request.status, reason=request.reason)
        return self.recorder.result(attempt.return_value)

    def _finish(self, status: str, error: TrainingFailedError | None = None, reason: str | None = None) -> None:
        """Record how the run ended, and tell the listeners (also when recording it failed)."""
        self.preemption.finishing = True
        try:
            self.recorder.finish(status, error, reason)
        finally:
            self.listeners.on_run_end(status, error)

    def _latest_entry(self) -> CheckpointEntry | None:
        return self.recorder.checkpoints[-1] if self.recorder.checkpoints else None

    def _latest_name(self) -> str | None:
        latest = self._latest_entry()
        return latest.dir_name if latest is not None else None

    def _start_message(self) -> protocol.Start:
        """Where the ranks of a new group start: after the last report, from the latest checkpoint."""
        latest = self._latest_entry()
        return protocol.Start(self.recorder.next_report_index, protocol.checkpoint_ref(latest),
                              self.has_resume_checkpoint and latest is None, list(self.recorder.committed_dir_names))

    def _failure_context(self) -> str:
        return f" (report #{self.recorder.next_report_index} was next)"

    # -- one attempt --------------------------------------------------------------------------

    def _run_attempt(self, start: AttemptStart) -> Attempt:
        self.recorder.set_world_size(start.world_size)
        attempt = Attempt(self._start_message(), ReportBarrier(start.world_size, self.report_timeout_s),
                          Liveness(start.world_size), CollectiveBarrier(start.world_size),
                          latest_sent=self._latest_entry())
        self.listeners.on_attempt_start(start)
        group = self.make_group(start.world_size)
        try:
            group.start()
            while attempt.outcome is None and not self.preemption.stops_now and not self._gives_up(attempt):
                for event in group.wait_events(self._time_to_deadline(attempt)):
                    self._handle(event, attempt, group)
                if not attempt.liveness.failures:
                    attempt.liveness.fail(attempt.barrier.overdue())
            if self.preemption.stops_now:
                self.preemption.finishing = True  # no signal may interrupt the stop
            if attempt.outcome is AttemptOutcome.FAILED and not self.preemption.noticed:
                attempt.stacks = group.dump_stacks(attempt.liveness.still_running())
        finally:
            group.stop()
        if attempt.outcome is not AttemptOutcome.SUCCEEDED:
            self.recorder.discard_uncommitted(attempt.commits.written_dir_names)
        return attempt

    def _gives_up(self, attempt: Attempt) -> bool:
        """Whether ranks told to stop had their time to leave (once every checkpoint is committed)."""
        return self.stopping.gives_up(bool(attempt.commits.pending))

    def _time_to_deadline(self, attempt: Attempt) -> float | None:
        """How long to wait for events: until the report barrier's, preemption's or stop's deadline."""
        waits = (attempt.barrier.time_to_deadline(), self.preemption.time_left(),
                 self.stopping.time_left(bool(attempt.commits.pending)))
        deadlines = [left for left in waits if left is not None]
        return min(deadlines, default=None)

    def _handle(self, event: Any, attempt: Attempt, group: WorkerGroup) -> None:
        if isinstance(event, protocol.Report):
            self._on_report(event, attempt, group)
        elif isinstance(event, protocol.CheckpointUploaded):
            self._on_uploaded(event, attempt)
        elif isinstance(event, protocol.WritingCheckpoint):
            attempt.commits.writing(event.dir_name)
        elif isinstance(event, protocol.Collective):
            self._on_collective(event, attempt, group)
        elif isinstance(event, protocol.CheckpointsQuery):
            attempt.queries.append(event)
        elif isinstance(event, protocol.Hello):
            self._on_hello(event, attempt, group)
        elif isinstance(event, protocol.Finished):
            self._on_finished(event, attempt, group)
        elif isinstance(event, protocol.Failed):
            if event.failure.error_type == HangUp.__name__:  # torchrun passed its SIGHUP to the ranks
                self.preemption.hang_up(event.failure.message)
            if self.stopping.left(event.failure):
                attempt.liveness.finish(event.failure.rank)  # told to stop: it left at that report
            else:
                attempt.liveness.fail([event.failure])
        elif isinstance(event, protocol.PreemptionNotice):
            self.preemption.notice(event.host, [event.rank], event.urgent, event.cause, event.deadline_ms)
        elif isinstance(event, WorkerExited):
            attempt.liveness.exit(event, group.output_tail)
            self.listeners.on_workers_changed(attempt.liveness.alive)
        if attempt.queries:
            self._answer_queries(attempt, group)

    def _on_hello(self, hello: protocol.Hello, attempt: Attempt, group: WorkerGroup) -> None:
        liveness = attempt.liveness
        liveness.hello(hello.rank)
        group.send(hello.rank, attempt.start)
        self.listeners.on_workers_changed(liveness.alive)
        if len(liveness.connected) == liveness.world_size:
            logger.debug("%d workers connected in %.2f s.", liveness.world_size, time.monotonic() - liveness.started_at)

    def _on_finished(self, finished: protocol.Finished, attempt: Attempt, group: WorkerGroup) -> None:
        attempt.liveness.finish(finished.rank)
        if finished.rank == 0:
            attempt.return_value = group.return_value(finished)
        attempt.liveness.fail(attempt.barrier.left_behind(attempt.liveness.finished))
        attempt.liveness.fail(attempt.collectives.left_behind(attempt.liveness.finished))

    def _on_report(self, report: protocol.Report, attempt: Attempt, group: WorkerGroup) -> None:
        calls = attempt.barrier.arrive(report)
        if calls is None:
            attempt.liveness.fail(attempt.barrier.left_behind(attempt.liveness.finished) or self._deadlock(attempt))
            return
        self._record(report.index, calls, attempt)
        latest = self._latest_entry()
        changed = latest if latest != attempt.latest_sent else None
        attempt.latest_sent = latest
        stop = self.preemption.stops_now or self.stopping.decide(report.index)
        done = protocol.ReportDone(report.index, protocol.checkpoint_ref(changed), self.preemption.message(), stop)
        for rank in range(attempt.world_size):
            group.send(rank, done)

    def _on_collective(self, call: protocol.Collective, attempt: Attempt, group: WorkerGroup) -> None:
        """One rank entered a barrier or broadcast; the last one releases every rank."""
        collectives = attempt.collectives
        done = collectives.arrive(call)
        if done is None:
            attempt.liveness.fail(
                collectives.mismatched() or collectives.left_behind(attempt.liveness.finished) or self._deadlock(attempt)
            )
            return
        for rank in range(attempt.world_size):
            group.send(rank, done)

    def _deadlock(self, attempt: Attempt) -> list[Any]:
        """Failures when every rank waits and none can be released (reports vs collectives)."""
        for index, calls in attempt.barrier.waiting.items():
            return attempt.collectives.deadlocked(calls, index)
        return []

    def _answer_queries(self, attempt: Attempt, group: WorkerGroup) -> None:
        """Answer the get_all_reported_checkpoints() calls whose reports' checkpoints are all
        committed (an ASYNC upload can keep one waiting)."""
        first_pending = attempt.commits.first_pending()
        waiting = []
        for query in attempt.queries:
            if first_pending is not None and first_pending < query.before_index:
                waiting.append(query)
            else:
                group.send(query.rank, protocol.ReportedCheckpoints(self._reported_checkpoints()))
        attempt.queries = waiting

    def _reported_checkpoints(self) -> list[CheckpointEntry]:
        """The kept checkpoints in Ray Train's order: report order, or worst to best by the
        checkpoint score when CheckpointConfig has a score attribute."""
        config = dataclasses.replace(self.recorder.checkpoint_config, num_to_keep=None)
        return best_checkpoints(self.recorder.checkpoints, config)

    def _record(self, index: int, calls: dict[int, protocol.Report], attempt: Attempt) -> None:
        """Log report ``index``; commit its checkpoint now, or once its ASYNC uploads end."""
        dir_name = agreed_dir_name(index, calls.values())
        report = self.recorder.log_report(index, calls[0].metrics_json or "{}", dir_name, times_record(calls))
        note_slow_rank(slowest_rank(self.recorder.recent_step_times))
        self.listeners.after_report(index, report["metrics"])
        if dir_name is not None:
            attempt.commits.reported(index, dir_name, report["metrics"], calls.values())
            self._commit_ready(attempt)

    def _on_uploaded(self, uploaded: protocol.CheckpointUploaded, attempt: Attempt) -> None:
        failure = attempt.commits.uploaded(uploaded)
        if failure is not None:
            attempt.liveness.fail([failure])
        else:
            self._commit_ready(attempt)

    def _commit_ready(self, attempt: Attempt) -> None:
        """Commit the checkpoints whose uploads all ended, in report order; after each, an
        elastic run that could have more workers now ends the attempt to grow."""
        for index, pending in attempt.commits.ready():
            self.recorder.commit_checkpoint(pending.dir_name, index, pending.metrics, pending.external_path)
            latest = self.recorder.latest_checkpoint
            assert latest is not None, f"{pending.dir_name} was committed but is not the latest checkpoint"
            self.listeners.on_checkpoint(index, latest)
            self.preemption.committed()
            attempt.liveness.grow_if(self.make_group.can_grow)
