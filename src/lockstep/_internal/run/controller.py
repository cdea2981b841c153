"""The controller: runs the worker group, turns the workers' reports into committed reports,
and decides what a failure means (restart from the latest checkpoint, or give up).

A run is a sequence of attempts. Each attempt starts a fresh worker group and ends with an
:class:`AttemptOutcome`: every rank finished, one failed, or an elastic run can grow. Its state
is split by job: the :class:`ReportBarrier` (``report()`` is a collective), the
:class:`CheckpointCommits` (committed in report order once uploaded) and the :class:`Liveness`
of its ranks. Whatever happens is told to the run's :class:`Listeners`.

Each rank that says Hello is told where the attempt starts (:class:`protocol.Start`): the next
report index and the run's latest checkpoint, as the run record has them when the group starts.

A preemption notice (see :mod:`lockstep._internal.run.preemption`) is told to every rank with the
next ReportDone; the run stops as ``preempted`` once a checkpoint is committed after it, when
the grace runs out, or at a second notice, without counting a failure. A stop requested by
``RunConfig(stop=...)`` or a callback (see :mod:`lockstep._internal.run.stopping`) is told the same
way, and the run ends ``stopped`` (or ``pruned``) once its ranks have left.
"""

from __future__ import annotations

import logging

from lockstep._internal.output.listeners import Listeners
from lockstep._internal.run.attempt_events import Attempt, AttemptEvents
from lockstep._internal.run.collectives import CollectiveBarrier
from lockstep._internal.run.failures import AttemptOutcome
from lockstep._internal.run.hang_diagnosis import hung_in_nccl, watch_for_hangs, with_whereabouts
from lockstep._internal.run.hang_watch import HangRule, HangWatch
from lockstep._internal.run.liveness import Liveness, RestartPolicy
from lockstep._internal.run.preemption import HangUp, Preemption, PreemptionStop
from lockstep._internal.run.report_barrier import ReportBarrier
from lockstep._internal.run.run_record import RunRecorder
from lockstep._internal.run.stopping import Stopping
from lockstep._internal.run.validation import Validations, ValidationSetup
from lockstep._internal.run.worker_group import GroupFactory
from lockstep._internal.wire import protocol
from lockstep.callbacks import AttemptReason, AttemptStart, RunInfo
from lockstep.config import DEFAULT_PREEMPTION_GRACE_S
from lockstep.errors import ControllerError, NCCLHangError, PreemptionError, TrainingFailedError, WorkerGroupError
from lockstep.result import Result

logger = logging.getLogger(__name__)


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
        hang_rule: When ranks that make no progress are a hang (see
            :mod:`lockstep._internal.run.hang_watch`); None: no hang detector.
        validation: The trainer's validation function and the executor's launcher, when the
            trainer has a ``validation_config`` (see :mod:`lockstep._internal.run.validation`).
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
        hang_rule: HangRule | None = None,
        validation: ValidationSetup | None = None,
    ) -> None:
        self.make_group = make_group
        self.recorder = recorder
        self.restart_policy = RestartPolicy(max_failures)
        self.has_resume_checkpoint = has_resume_checkpoint
        self.report_timeout_s = report_timeout_s
        self.preemption = preemption or Preemption(DEFAULT_PREEMPTION_GRACE_S)
        self.hang_rule = hang_rule
        storage = recorder.storage
        listeners = listeners or Listeners(RunInfo(storage.name, storage.display_path, recorder.world_size, ""))
        self.listeners = listeners
        self.stopping = Stopping(listeners.run)
        self.validations = Validations(validation, recorder) if validation is not None else None
        if validation is None and recorder.pending_validations():
            logger.warning(
                "Checkpoints of an earlier run await validation (%s), but this trainer has no validation_config: "
                "they are kept, unvalidated, until a run of %s with one validates them.",
                ", ".join(entry.dir_name for entry in recorder.pending_validations()),
                storage.name,
            )
        self.events = AttemptEvents(
            make_group=make_group,
            recorder=recorder,
            listeners=listeners,
            preemption=self.preemption,
            stopping=self.stopping,
            validations=self.validations,
            rank_reports=listeners.user_callbacks,
        )

    @property
    def failure_history(self) -> list[TrainingFailedError]:
        """The error of each failed attempt so far."""
        return self.restart_policy.history

    def run(self) -> Result:
        """Run attempts until one succeeds or failures exceed ``max_failures``."""
        self.listeners.on_run_start()
        try:
            if self.validations is not None:
                self.validations.poll()  # an earlier run's pending validations start now
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
                f"(report #{self.recorder.next_report_index} was next).",
                controller_failure=error,
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
            attempt = self._run_attempt(
                AttemptStart(
                    number=number,
                    world_size=self.make_group.size_now(),
                    reason=reason,
                    checkpoint=self.recorder.latest_checkpoint,
                    failures=len(self.failure_history),
                    max_failures=self.restart_policy.max_failures,
                )
            )
            if self.stopping.request is not None:
                return self._stopped(attempt)
            if self.preemption.noticed and attempt.outcome is not AttemptOutcome.SUCCEEDED:
                raise self.preemption.error(self._latest_name())
            if attempt.outcome is AttemptOutcome.SUCCEEDED:
                assert not attempt.commits.pending, (
                    f"uploads still pending after every rank finished: {attempt.commits.pending}"
                )
                self._wait_for_validations()
                self._finish("finished")
                return self.recorder.result(attempt.return_value)
            if attempt.outcome is AttemptOutcome.FAILED:
                self._fail_or_go_on(attempt)
            number, reason = number + 1, "grow" if attempt.outcome is AttemptOutcome.GROW else "restart"

    def _fail_or_go_on(self, attempt: Attempt) -> None:
        """Count the failed attempt; raise its error unless the policy allows a restart."""
        kind = NCCLHangError if hung_in_nccl(attempt) else WorkerGroupError
        error = kind.from_failures(attempt.liveness.failures, self._failure_context(), attempt.stacks)
        restarting = self.restart_policy.record(error)
        self.recorder.count_failure()
        self.listeners.on_failure(error, restarting)
        if not restarting:
            self._wait_for_validations()
            raise self.restart_policy.final_error(error)

    def _stopped(self, attempt: Attempt) -> Result:
        """End a run that was asked to stop, once its ranks have left."""
        request = self.stopping.request
        assert request is not None
        if attempt.outcome is AttemptOutcome.FAILED:
            logger.warning(
                "While run %s stopped: %s",
                self.recorder.storage.name,
                WorkerGroupError.from_failures(attempt.liveness.failures, self._failure_context()),
            )
        self._wait_for_validations()
        self._finish(request.status, reason=request.reason)
        return self.recorder.result(attempt.return_value)

    def _finish(self, status: str, error: TrainingFailedError | None = None, reason: str | None = None) -> None:
        """Record how the run ended, and tell the listeners (also when recording it failed)."""
        self.preemption.finishing = True
        try:
            if self.validations is not None:
                self.validations.abort()  # none is left unless the run was cut short
            self.recorder.finish(status, error, reason)
        finally:
            self.listeners.on_run_end(status, error)

    def _wait_for_validations(self) -> None:
        """As in Ray Train, a run that ends (finished, stopped or failed) first lets its
        pending validations end; an interrupted or preempted one stops them instead."""
        if self.validations is not None:
            self.validations.wait_all(check=lambda: self.preemption.stops_now)  # raises HangUp once interrupted

    def _latest_name(self) -> str | None:
        latest = self.recorder.latest_entry()
        return latest.dir_name if latest is not None else None

    def _start_message(self) -> protocol.Start:
        """Where the ranks of a new group start: after the last report, from the latest checkpoint."""
        latest = self.recorder.latest_entry()
        return protocol.Start(
            self.recorder.next_report_index,
            protocol.checkpoint_ref(latest),
            self.has_resume_checkpoint and latest is None,
            list(self.recorder.committed_dir_names),
            progress_every_s=self.hang_rule.progress_every_s if self.hang_rule is not None else None,
        )

    def _failure_context(self) -> str:
        return f" (report #{self.recorder.next_report_index} was next)"

    # -- one attempt --------------------------------------------------------------------------

    def _run_attempt(self, start: AttemptStart) -> Attempt:
        self.recorder.set_world_size(start.world_size)
        attempt = Attempt(
            self._start_message(),
            ReportBarrier(start.world_size, self.report_timeout_s),
            Liveness(start.world_size),
            CollectiveBarrier(start.world_size),
            latest_sent=self.recorder.latest_entry(),
            hangs=HangWatch(self.hang_rule) if self.hang_rule is not None else None,
        )
        self.listeners.on_attempt_start(start)
        group = self.make_group(start.world_size)
        try:
            group.start()
            if attempt.hangs is not None:
                attempt.hangs.saw_progress()  # the ranks' time starts now
            while attempt.outcome is None and not self.preemption.stops_now and not self._gives_up(attempt):
                for event in group.wait_events(self._time_to_deadline(attempt)):
                    self.events.handle(event, attempt, group)
                self.events.check(attempt, group)
                if not attempt.liveness.failures:
                    attempt.liveness.fail(attempt.barrier.overdue())
                if not attempt.liveness.failures and attempt.hangs is not None:
                    watch_for_hangs(attempt, group)
            if self.preemption.stops_now:
                self.preemption.finishing = True  # no signal may interrupt the stop
            if attempt.outcome is AttemptOutcome.FAILED and not self.preemption.noticed:
                attempt.stacks = group.dump_stacks(attempt.liveness.still_running())
                if attempt.hangs is not None:
                    attempt.stacks = with_whereabouts(attempt.stacks, attempt.hangs)
        finally:
            group.stop()
            if attempt.outcome is not AttemptOutcome.SUCCEEDED:  # also when a stop or Ctrl-C cut it short
                self._discard_uncommitted(attempt)
        return attempt

    def _discard_uncommitted(self, attempt: Attempt) -> None:
        """Delete the folders the attempt's ranks began writing and no commit names (a rerun
        would otherwise write into them); a storage error here is logged, not raised over the
        attempt's own end."""
        try:
            self.recorder.discard_uncommitted(attempt.commits.written_dir_names)
        except Exception as error:  # noqa: BLE001 - the attempt's own error or outcome comes first
            logger.warning(
                "could not delete the unfinished checkpoint folders %s: %s", attempt.commits.written_dir_names, error
            )

    def _gives_up(self, attempt: Attempt) -> bool:
        """Whether ranks told to stop had their time to leave (once every checkpoint is committed)."""
        return self.stopping.gives_up(bool(attempt.commits.pending))

    def _time_to_deadline(self, attempt: Attempt) -> float | None:
        """How long to wait for events: until the report barrier's, preemption's, stop's or
        hang watch's deadline."""
        waits = (
            attempt.barrier.time_to_deadline(),
            self.preemption.time_left(),
            self.stopping.time_left(bool(attempt.commits.pending)),
            attempt.hangs.time_to_deadline() if attempt.hangs is not None else None,
            self.events.time_to_next_check(attempt),
        )
        deadlines = [left for left in waits if left is not None]
        return min(deadlines, default=None)
