"""Who is hung, once the :class:`~lockstep._internal.run.hang_watch.HangWatch` has found that no
rank made progress for too long and the ranks said where they are.

A rank waits when it is in a ``report()`` or ``lockstep.collective`` call others have not made
(the driver knows) or in a torch.distributed collective (its flight recorder knows). The hung
ranks are the others:

- with some ranks waiting and the flight recorder on, every rank that waits in nothing;
- without the flight recorder (a rank in a torch collective then looks like one in its own
  code), the ranks that are behind: the least work done;
- with no rank waiting and all equally far, every rank, and the error says that none is behind;
- with every rank waiting, every rank, each with what it waits in (collectives that can never
  meet).

Runs once per hang: its O(ranks) work is not per event.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from lockstep._internal.run.attempt_events import Attempt
from lockstep._internal.run.collectives import OP_NAMES
from lockstep._internal.run.failures import FailureKind
from lockstep._internal.run.hang_watch import HangWatch
from lockstep._internal.run.worker_group import WorkerGroup
from lockstep._internal.wire import protocol
from lockstep.errors import WorkerFailure

__all__ = ["hang_failures", "hung_in_nccl", "ranks_text", "watch_for_hangs", "with_whereabouts"]

logger = logging.getLogger(__name__)

#: How many different places the message lists where ranks wait.
PLACES_SHOWN = 5
FIX = (
    "If the ranks were busy on purpose, raise FailureConfig.hang_timeout_s (and hang_step_multiple, "
    "hang_first_step_timeout_s), or turn the hang detector off with FailureConfig(hang_timeout_s=None)."
)


def watch_for_hangs(attempt: Attempt, group: WorkerGroup) -> None:
    """Once the attempt's watch suspects a hang, ask the running ranks where they are; once they
    answered (or the time to answer is up), fail the hung ranks."""
    watch = attempt.hangs
    assert watch is not None, "watch_for_hangs needs an attempt with a hang watch"
    running = [rank for rank in attempt.liveness.still_running() if rank not in attempt.liveness.finished]
    if not running:  # every rank's train function returned: their processes are ending
        watch.saw_progress()
    elif watch.due():
        logger.warning("No rank has made progress for %.3g s: asking the ranks where they are.", watch.quiet_s())
        watch.start_probe(running)
        for rank in running:
            group.send(rank, protocol.StacksWanted())
    elif watch.probe_over():
        failures = hang_failures(watch, running, in_lockstep_calls(attempt))
        attempt.liveness.fail(failures)


def in_lockstep_calls(attempt: Attempt) -> dict[int, str]:
    """The ranks that wait in a ``report()`` or ``lockstep.collective`` call, and in which."""
    places = {rank: f"report #{index}" for index, calls in attempt.barrier.waiting.items() for rank in calls}
    for rank, call in attempt.collectives.waiting.items():
        places[rank] = f"{OP_NAMES.get(call.op, call.op)} (lockstep collective #{call.seq})"
    return places


def hang_failures(watch: HangWatch, running: Iterable[int], in_lockstep: Mapping[int, str]) -> list[WorkerFailure]:
    """The Hang failures of the hung ranks among ``running`` (``in_lockstep``: ranks waiting
    in a lockstep call, and in which)."""
    running = sorted(running)
    waits = {rank: place for rank in running if (place := in_lockstep.get(rank) or _torch_collective(watch, rank))}
    others = [rank for rank in running if rank not in waits]
    head = f"no rank has made progress for {watch.quiet_s():.3g} s (no training step, report or collective)"
    stuck_working = [rank for rank in running if rank in watch.busy]
    if stuck_working:
        return [FailureKind.HANG.failure(rank, _stuck_in_own_work(head, watch)) for rank in stuck_working]
    rule = f"The hang threshold: {watch.rule.describe(watch.stepped, watch.step_s)}. {FIX}"
    if not others:
        return [
            FailureKind.HANG.failure(
                rank,
                f"{head}, and every running rank waits: this one in {waits[rank]}; {_places(waits)}. Ranks waiting "
                f"in different collectives never meet. {rule}",
            )
            for rank in running
        ]
    known = any(answer.collectives_known for answer in watch.answers.values())
    why = {rank: "is in no collective" for rank in others} if waits and known else _behind(watch, others)
    if not waits and len(why) == len(running):
        none_behind = (
            f"{head}, and no rank is behind the others (none waits in a collective lockstep or torch's flight "
            "recorder knows of): they may all wait for something outside the job (a lock, a file, a service) or "
            f"all be in the same collective; see where each rank is below. {rule}"
        )
        return [FailureKind.HANG.failure(rank, none_behind) for rank in running]
    waiting = f" while {_places(waits)}" if waits else ""
    return [FailureKind.HANG.failure(rank, f"{head}; this rank {why[rank]}{waiting}. {rule}") for rank in why]


def _stuck_in_own_work(head: str, watch: HangWatch) -> str:
    return (
        f"{head}; this rank has been in lockstep's own work (saving or uploading a checkpoint) for longer than "
        f"FailureConfig.report_timeout_s={watch.rule.busy_limit_s:g} s without finishing it: storage that stopped "
        "answering (a lost NFS mount) or a checkpoint_upload_fn that never returns; see where it is below. For "
        "checkpoints that take longer to write, raise report_timeout_s."
    )


def _torch_collective(watch: HangWatch, rank: int) -> str | None:
    answer = watch.answers.get(rank)
    return answer.collective if answer is not None else None


def _behind(watch: HangWatch, others: list[int]) -> dict[int, str]:
    """The ranks of ``others`` that did the least work, each with why it is named."""
    done = {rank: _work(watch, rank) for rank in others}
    least = min(done.values())
    most = max(done.values())
    reason = f"is behind (progress count {least}, others up to {most})" if most > least else "is behind"
    return {rank: reason for rank, work in done.items() if work == least}


def _work(watch: HangWatch, rank: int) -> int:
    answer = watch.answers.get(rank)
    return answer.work if answer is not None else watch.work.get(rank, 0)


def _places(waits: Mapping[int, str]) -> str:
    """Where the waiting ranks wait, grouped: "rank(s) 0, 2-5 wait in X; rank 1 waits in Y"."""
    by_place: dict[str, list[int]] = {}
    for rank, place in waits.items():
        by_place.setdefault(place, []).append(rank)
    parts = [_waiting_in(ranks, place) for place, ranks in sorted(by_place.items(), key=lambda item: item[1][0])]
    more = len(parts) - PLACES_SHOWN
    return "; ".join(parts[:PLACES_SHOWN]) + (f"; and {more} other place(s)" if more > 0 else "")


def _waiting_in(ranks: list[int], place: str) -> str:
    return f"rank {ranks[0]} waits in {place}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)} wait in {place}"


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks as runs: ``0, 2-5, 9``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def with_whereabouts(stacks: Mapping[int, str], watch: HangWatch) -> dict[int, str]:
    """Each rank's stack (the executor's own dump, else the rank's answer), headed by the torch
    collective it waits in when it named one."""
    merged = dict(stacks)
    for rank, answer in watch.answers.items():
        stack = merged.get(rank) or answer.stacks
        merged[rank] = f"(waiting in torch collective {answer.collective})\n{stack}" if answer.collective else stack
    return {rank: stack for rank, stack in merged.items() if stack}


def hung_in_nccl(attempt: Attempt) -> bool:
    """Whether the attempt failed for a hang in which a rank waits in an NCCL collective: where
    Ray Train raises ``NCCLHangError``."""
    hung = any(failure.error_type == FailureKind.HANG for failure in attempt.liveness.failures)
    answers = attempt.hangs.answers.values() if attempt.hangs is not None else ()
    return hung and any((answer.collective or "").startswith("nccl:") for answer in answers)
