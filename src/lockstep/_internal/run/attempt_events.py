"""What each event of a worker group does to the attempt it belongs to: a rank's report joins
the report barrier and, once every rank made it, is recorded (its checkpoint committed when its
uploads end); collectives are released when the last rank arrives; hellos are answered with
where the attempt starts; failures, exits and preemption notices go to the attempt's liveness
and the run's preemption state (see :mod:`lockstep._internal.run.controller`, which runs the
attempts)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.output.listeners import Listeners
from lockstep._internal.output.progress import note_slow_rank
from lockstep._internal.output.user_callbacks import UserCallbacks
from lockstep._internal.persist.retry import Outage
from lockstep._internal.persist.storage import CheckpointEntry
from lockstep._internal.run.checkpoint_commits import CheckpointCommits, agreed_dir_name
from lockstep._internal.run.checkpoints import ranked
from lockstep._internal.run.collectives import CollectiveBarrier
from lockstep._internal.run.failures import AttemptOutcome
from lockstep._internal.run.hang_watch import HangWatch
from lockstep._internal.run.liveness import Liveness
from lockstep._internal.run.preemption import HangUp, Preemption
from lockstep._internal.run.report_barrier import ReportBarrier
from lockstep._internal.run.run_record import RunRecorder
from lockstep._internal.run.stopping import Stopping
from lockstep._internal.run.stragglers import times_record
from lockstep._internal.run.validation import Validations
from lockstep._internal.run.worker_group import GroupFactory, WorkerExited, WorkerGroup
from lockstep._internal.wire import protocol

logger = logging.getLogger(__name__)

#: Events that show a rank got something done (for the hang watch).
PROGRESS_EVENTS = (
    protocol.Hello,
    protocol.Report,
    protocol.Collective,
    protocol.WritingCheckpoint,
    protocol.CheckpointUploaded,
    protocol.Finished,
)


@dataclass
class Attempt:
    """What the controller knows about the current worker group, by job."""

    start: protocol.Start
    barrier: ReportBarrier
    liveness: Liveness
    collectives: CollectiveBarrier
    commits: CheckpointCommits = field(default_factory=CheckpointCommits)
    queries: list[tuple[protocol.CheckpointsQuery, float | None]] = field(default_factory=list)
    latest_sent: CheckpointEntry | None = None
    return_value: Any = None
    stacks: dict[int, str] = field(default_factory=dict)
    hangs: HangWatch | None = None

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self.liveness.world_size

    @property
    def outcome(self) -> AttemptOutcome | None:
        """How the attempt ended, or ``None`` while it goes on."""
        return self.liveness.outcome


class AttemptEvents:
    """Handles the events of the run's attempts, against the run's record, listeners,
    preemption and stop state."""

    def __init__(
        self,
        make_group: GroupFactory,
        recorder: RunRecorder,
        listeners: Listeners,
        preemption: Preemption,
        stopping: Stopping,
        validations: Validations | None = None,
        rank_reports: UserCallbacks | None = None,
    ) -> None:
        self.make_group = make_group
        self.rank_reports = rank_reports  # Ray's UserCallbacks: told every rank's metrics of each report
        self.recorder = recorder
        self.listeners = listeners
        self.preemption = preemption
        self.stopping = stopping
        self.validations = validations
        self._handlers: dict[type, Callable[[Any, Attempt, WorkerGroup], None]] = {
            protocol.Report: self._on_report,
            protocol.CheckpointUploaded: self._on_uploaded,
            protocol.StorageOutage: self._on_storage_outage,
            protocol.WritingCheckpoint: self._on_writing,
            protocol.Collective: self._on_collective,
            protocol.CheckpointsQuery: self._on_query,
            protocol.Hello: self._on_hello,
            protocol.Finished: self._on_finished,
            protocol.Failed: self._on_failed,
            protocol.PreemptionNotice: self._on_notice,
            protocol.Progress: self._on_progress,
            protocol.Stacks: self._on_stacks,
            WorkerExited: self._on_exited,
        }

    def handle(self, event: Any, attempt: Attempt, group: WorkerGroup) -> None:
        """What one event of ``group`` (a rank's message or a WorkerExited) does to ``attempt``."""
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event, attempt, group)
        if attempt.queries:
            self._answer_queries(attempt, group)
        if attempt.hangs is not None and type(event) in PROGRESS_EVENTS:
            attempt.hangs.saw_progress()  # after handling: time the driver took is not the ranks'

    def _on_progress(self, progress: protocol.Progress, attempt: Attempt, group: WorkerGroup) -> None:
        if attempt.hangs is not None:
            attempt.hangs.progress(progress)

    def _on_stacks(self, stacks: protocol.Stacks, attempt: Attempt, group: WorkerGroup) -> None:
        if attempt.hangs is not None:
            attempt.hangs.answered(stacks)

    def _on_writing(self, writing: protocol.WritingCheckpoint, attempt: Attempt, group: WorkerGroup) -> None:
        attempt.commits.writing(writing.dir_name)

    def _on_query(self, query: protocol.CheckpointsQuery, attempt: Attempt, group: WorkerGroup) -> None:
        deadline = None if query.timeout_s is None else time.monotonic() + max(0.0, query.timeout_s)
        attempt.queries.append((query, deadline))

    def time_to_next_check(self, attempt: Attempt) -> float | None:
        """How long the controller may wait for events before :meth:`check` must run: while a
        validation runs, or a checkpoints query has a timeout."""
        now = time.monotonic()
        waits = [deadline - now for _, deadline in attempt.queries if deadline is not None]
        if self.validations is not None and (left := self.validations.time_left()) is not None:
            waits.append(left)
        return max(0.0, min(waits)) if waits else None

    def check(self, attempt: Attempt, group: WorkerGroup) -> None:
        """What time alone changes: validations that ended or ran out of time, and checkpoints
        queries whose wait is over."""
        if self.validations is not None:
            self.validations.poll()
        if attempt.queries:
            self._answer_queries(attempt, group)

    def _on_failed(self, failed: protocol.Failed, attempt: Attempt, group: WorkerGroup) -> None:
        if failed.failure.error_type == HangUp.__name__:  # torchrun passed its SIGHUP to the ranks
            self.preemption.hang_up(failed.failure.message)
        if self.stopping.left(failed.failure):
            attempt.liveness.finish(failed.failure.rank)  # told to stop: it left at that report
        else:
            attempt.liveness.fail([failed.failure])

    def _on_notice(self, notice: protocol.PreemptionNotice, attempt: Attempt, group: WorkerGroup) -> None:
        self.preemption.notice(
            host=notice.host,
            ranks=[notice.rank],
            urgent=notice.urgent,
            cause=notice.cause,
            deadline_ms=notice.deadline_ms,
        )

    def _on_exited(self, exited: WorkerExited, attempt: Attempt, group: WorkerGroup) -> None:
        if attempt.hangs is not None:
            attempt.hangs.rank_ended(exited.rank)
        attempt.liveness.exit(exited, group.output_tail)
        self.listeners.on_workers_changed(attempt.liveness.alive)

    def _on_hello(self, hello: protocol.Hello, attempt: Attempt, group: WorkerGroup) -> None:
        liveness = attempt.liveness
        liveness.hello(hello.rank)
        group.send(hello.rank, attempt.start)
        self.listeners.on_workers_changed(liveness.alive)
        if len(liveness.connected) == liveness.world_size:
            logger.debug("%d workers connected in %.2f s.", liveness.world_size, time.monotonic() - liveness.started_at)

    def _on_finished(self, finished: protocol.Finished, attempt: Attempt, group: WorkerGroup) -> None:
        if attempt.hangs is not None:
            attempt.hangs.rank_ended(finished.rank)
        attempt.liveness.finish(finished.rank)
        if finished.rank == 0:
            attempt.return_value = group.return_value(finished)
        attempt.liveness.fail(attempt.barrier.left_behind(attempt.liveness.finished))
        attempt.liveness.fail(attempt.collectives.left_behind(attempt.liveness.finished))

    def _on_report(self, report: protocol.Report, attempt: Attempt, group: WorkerGroup) -> None:
        calls = attempt.barrier.arrive(report)
        if calls is None:  # not the last: only a finished rank or a waiting collective can strand it
            if attempt.liveness.finished or attempt.collectives.waiting:
                attempt.liveness.fail(attempt.barrier.left_behind(attempt.liveness.finished) or self._deadlock(attempt))
            return
        self.preemption.report_completed(report.index)
        self._record(report.index, calls, attempt)
        if attempt.hangs is not None:
            attempt.hangs.report_done()
        latest = self.recorder.latest_entry()
        changed = latest if latest != attempt.latest_sent else None
        attempt.latest_sent = latest
        stop = self.preemption.stops_now or self.stopping.decide(report.index)
        done = protocol.ReportDone(report.index, protocol.checkpoint_ref(changed), self.preemption.message(), stop)
        group.send_all(done, range(attempt.world_size))

    def _on_collective(self, call: protocol.Collective, attempt: Attempt, group: WorkerGroup) -> None:
        """One rank entered a barrier or broadcast; the last one releases every rank."""
        collectives = attempt.collectives
        done = collectives.arrive(call)
        if done is None:
            attempt.liveness.fail(
                collectives.mismatched()
                or collectives.left_behind(attempt.liveness.finished)
                or self._deadlock(attempt)
            )
            return
        group.send_all(done, range(attempt.world_size))

    def _deadlock(self, attempt: Attempt) -> list[Any]:
        """Failures when every rank waits and none can be released (reports vs collectives)."""
        for index, calls in attempt.barrier.waiting.items():
            return attempt.collectives.deadlocked(calls, index)
        return []

    def _answer_queries(self, attempt: Attempt, group: WorkerGroup) -> None:
        """Answer the get_all_reported_checkpoints() calls whose reports' checkpoints are all
        committed (an ASYNC upload can keep one waiting) and, for VALIDATED ones, once no
        validation is pending; or whose timeout has passed."""
        first_pending = attempt.commits.first_pending()
        validating = self.validations is not None and self.validations.pending
        now = time.monotonic()
        waiting = []
        for query, deadline in attempt.queries:
            uncommitted = first_pending is not None and first_pending < query.before_index
            if (uncommitted or (query.validated and validating)) and (deadline is None or now < deadline):
                waiting.append((query, deadline))
            else:
                group.send(query.rank, protocol.ReportedCheckpoints(self._reported_checkpoints()))
        attempt.queries = waiting
        if attempt.hangs is not None and validating and any(query.validated for query, _ in waiting):
            attempt.hangs.saw_progress()  # that rank waits for the driver's validation (its own bound), not hung

    def _reported_checkpoints(self) -> list[CheckpointEntry]:
        """The kept checkpoints in Ray Train's order: report order, or worst to best by the
        checkpoint score when CheckpointConfig has a score attribute."""
        return ranked(self.recorder.checkpoints, self.recorder.checkpoint_config)

    def _record(self, index: int, calls: dict[int, protocol.Report], attempt: Attempt) -> None:
        """Log report ``index``; commit its checkpoint now, or once its ASYNC uploads end."""
        dir_name = agreed_dir_name(index, calls.values())
        report = self.recorder.log_report(index, calls[0].metrics_json or "{}", dir_name, times_record(calls))
        note_slow_rank(self.recorder.slow_ranks.slowest, self.recorder.storage.name)
        self.listeners.after_report(index, report["metrics"])
        if dir_name is not None:
            attempt.commits.reported(index, dir_name, report["metrics"], calls.values())
            self._commit_ready(attempt)
        if self.rank_reports is not None:
            self.rank_reports.after_rank_reports(index, rank_metrics(calls), dir_name is not None)

    def _on_storage_outage(self, outage: protocol.StorageOutage, attempt: Attempt, group: WorkerGroup) -> None:
        self.recorder.note_outage(Outage(outage.started_at, outage.lasted_s, outage.retries), f"rank {outage.rank}")

    def _on_uploaded(self, uploaded: protocol.CheckpointUploaded, attempt: Attempt, group: WorkerGroup) -> None:
        failure = attempt.commits.uploaded(uploaded)
        if failure is not None:
            attempt.liveness.fail([failure])
        else:
            self._commit_ready(attempt)

    def _commit_ready(self, attempt: Attempt) -> None:
        """Commit the checkpoints whose uploads all ended, in report order; after each, an
        elastic run that could have more workers now ends the attempt to grow."""
        for index, pending in attempt.commits.ready():
            entry = self.recorder.commit_checkpoint(
                pending.dir_name,
                index,
                pending.metrics,
                external_path=pending.external_path,
                validation=pending.validation,
                files=pending.files,
            )
            if self.validations is not None and entry.validation_request is not None:
                self.validations.submit(entry)
            latest = self.recorder.latest_checkpoint
            assert latest is not None, f"{pending.dir_name} was committed but is not the latest checkpoint"
            self.listeners.on_checkpoint(index, latest)
            self.preemption.committed(index)
            attempt.liveness.grow_if(self.make_group.can_grow)


def rank_metrics(calls: dict[int, protocol.Report]) -> list[dict[str, Any]]:
    """Every rank's metrics of one report, by rank (every rank sends them when a UserCallback
    asks for them; a rank that sent none counts as empty)."""
    return [json.loads(calls[rank].metrics_json or "{}") for rank in sorted(calls)]
