"""The driver's side of ``lockstep.collective``: ``barrier()`` and ``broadcast_from_rank_zero()``
are collectives over the driver channel, like ``report()``. The controller collects each rank's
call of collective number ``seq`` and releases them all when the last rank has made it.

A rank blocks in a collective until it is released, so ranks can be in at most one collective at
a time. Two ways it is never released are caught: a rank that returned from the train function
while others wait in one, and ranks that all wait, some in a collective and the others in a
``report()`` or a different collective (they call them in different orders): a deadlock that
would otherwise last for ever.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from lockstep._internal.run.failures import FailureKind
from lockstep._internal.wire.protocol import Collective, CollectiveDone
from lockstep.errors import WorkerFailure

OP_NAMES = {"barrier": "barrier()", "broadcast": "broadcast_from_rank_zero()"}


class CollectiveBarrier:
    """The collective calls of one worker group until every rank has made the current one."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.waiting: dict[int, Collective] = {}

    def arrive(self, call: Collective) -> CollectiveDone | None:
        """Add one rank's call; when it is the last, return the answer every rank gets."""
        self.waiting[call.rank] = call
        if len(self.waiting) < self.world_size:
            return None
        calls, self.waiting = self.waiting, {}
        return CollectiveDone(call.seq, calls[0].data if 0 in calls else None)

    def mismatched(self) -> list[WorkerFailure]:
        """Failures for waiting ranks that called a different collective than rank 0 (or the
        lowest waiting rank): they can never meet."""
        if not self.waiting:
            return []
        first = self.waiting[min(self.waiting)]
        return [
            _mismatch(call.rank, f"called {_describe(call)} while rank {first.rank} waits in {_describe(first)}")
            for call in self.waiting.values()
            if (call.seq, call.op) != (first.seq, first.op)
        ]

    def left_behind(self, finished: Collection[int]) -> list[WorkerFailure]:
        """Failures for ``finished`` ranks that will never make the collective others wait in."""
        if not self.waiting:
            return []
        first = self.waiting[min(self.waiting)]
        return [
            _mismatch(
                rank,
                f"returned from the train function while rank(s) {_ranks(self.waiting)} wait in {_describe(first)}",
            )
            for rank in sorted(finished)
            if rank not in self.waiting
        ]

    def deadlocked(self, in_report: Iterable[int], report_index: int | None) -> list[WorkerFailure]:
        """Failures when every rank waits, some in a collective and the others in ``report()``
        #``report_index``: neither can ever be released."""
        if not self.waiting:
            return []
        reporting = set(in_report)
        if not reporting or len(reporting | set(self.waiting)) < self.world_size:
            return []
        first = self.waiting[min(self.waiting)]
        return [
            _mismatch(
                rank, f"waits in report #{report_index} while rank(s) {_ranks(self.waiting)} wait in {_describe(first)}"
            )
            for rank in sorted(reporting)
        ]


def _mismatch(rank: int, what: str) -> WorkerFailure:
    return FailureKind.REPORT_MISMATCH.failure(
        rank,
        f"{what}; every rank must call report(), barrier() and broadcast_from_rank_zero() in the same order "
        "and the same number of times.",
    )


def _describe(call: Collective) -> str:
    return f"{OP_NAMES.get(call.op, call.op)} (collective #{call.seq})"


def _ranks(calls: Collection[int]) -> str:
    return ", ".join(str(rank) for rank in sorted(calls))
