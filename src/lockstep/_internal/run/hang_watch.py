"""The hang detector, driver side: when the ranks of an attempt stop making progress, say so
within a bound that follows the run's own pace.

Progress is anything a rank gets done: a training step, a forward pass of a prepared model, a
batch of a prepared loader, a ``report()``, a collective, lockstep's own long work (a
checkpoint upload), as each rank's progress thread tells it (:class:`protocol.Progress`, only
when something changed and at most every :attr:`HangRule.progress_every_s`), and every report,
collective, upload and hello the driver sees itself. A synchronous job that has a stuck rank
soon has every rank stuck (the others wait for it), so one clock is enough: the time since any
rank last made progress. Each event costs O(1), whatever the number of ranks.

When that time passes the threshold of :class:`HangRule` (by default max(60 s, 10 x the median
recent step time); 600 s before the first training step of the attempt; while a rank is in
lockstep's own long work, at least ``FailureConfig.report_timeout_s``), the watch asks every running rank where it is
(:class:`protocol.StacksWanted`), waits up to :data:`PROBE_WAIT_S` for the answers, and
:mod:`lockstep._internal.run.hang_diagnosis` names the ranks that stopped. Any progress in the
meantime calls the alarm off.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockstep.config import DEFAULT_HANG_FIRST_STEP_TIMEOUT_S, DEFAULT_HANG_STEP_MULTIPLE, DEFAULT_HANG_TIMEOUT_S

if TYPE_CHECKING:
    from lockstep._internal.wire import protocol
    from lockstep.config import FailureConfig

__all__ = ["PROBE_WAIT_S", "HangRule", "HangWatch"]

#: How long the watch waits for the ranks to say where they are, once it suspects a hang.
PROBE_WAIT_S = 3.0
#: How many recent report intervals stand in for step times when no rank counts steps.
REPORT_INTERVALS_KEPT = 20
#: The bounds of the ranks' progress interval: often enough for the smallest threshold, never
#: more often than this floor (nor less often than the cap, to keep the driver informed).
PROGRESS_EVERY_S_BOUNDS = (0.05, 5.0)


@dataclass(frozen=True)
class HangRule:
    """When no progress makes a hang (the ``hang_*`` fields of ``FailureConfig``).

    Attributes:
        timeout_s: After the first training step: the least time without progress that is a hang.
        step_multiple: ... or this many median step times, when that is longer.
        first_step_timeout_s: Before the first training step (None: no hang is named then).
        busy_limit_s: While a rank is in lockstep's own long work (a checkpoint upload), the
            least time without other progress that is a hang (``FailureConfig.report_timeout_s``;
            None: no hang is named then).
    """

    timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    step_multiple: float = DEFAULT_HANG_STEP_MULTIPLE
    first_step_timeout_s: float | None = DEFAULT_HANG_FIRST_STEP_TIMEOUT_S
    busy_limit_s: float | None = None

    @classmethod
    def from_config(cls, config: FailureConfig) -> HangRule | None:
        """The rule ``config`` asks for; None when it turns the detector off."""
        if config.hang_timeout_s is None:
            return None
        return cls(
            timeout_s=config.hang_timeout_s,
            step_multiple=config.hang_step_multiple,
            first_step_timeout_s=config.hang_first_step_timeout_s,
            busy_limit_s=config.report_timeout_s,
        )

    def threshold_s(self, stepped: bool, median_step_s: float | None) -> float | None:
        """The time without progress that is a hang: before the first step (``stepped``
        False) the first-step timeout, after it max(timeout, multiple x the median step time)."""
        if not stepped:
            return self.first_step_timeout_s
        return max(self.timeout_s, self.step_multiple * (median_step_s or 0.0))

    @property
    def progress_every_s(self) -> float:
        """How often, at most, ranks send their progress: a quarter of the shortest threshold,
        within :data:`PROGRESS_EVERY_S_BOUNDS`."""
        shortest = min(self.timeout_s, self.first_step_timeout_s or self.timeout_s)
        low, high = PROGRESS_EVERY_S_BOUNDS
        return min(high, max(low, shortest / 4))

    def describe(self, stepped: bool, median_step_s: float | None) -> str:
        """The threshold in force, and the settings it comes from, for an error message."""
        if not stepped:
            return (
                f"{self.first_step_timeout_s:g} s before the first training step "
                "(FailureConfig.hang_first_step_timeout_s)"
            )
        step = f"{median_step_s:.3g} s" if median_step_s is not None else "not known yet"
        return (
            f"{self.threshold_s(stepped, median_step_s):.3g} s = max(FailureConfig.hang_timeout_s={self.timeout_s:g}, "
            f"hang_step_multiple={self.step_multiple:g} x the median step time, {step})"
        )


class HangWatch:
    """The progress of one attempt's ranks, and the alarm when it stops (see the module's
    docstring).

    Args:
        rule: When no progress makes a hang.
        clock: Seconds, monotonic (``time.monotonic``; a test may pass its own).
    """

    def __init__(self, rule: HangRule, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule = rule
        self.clock = clock
        self.last_progress_at = clock()
        self.work: dict[int, int] = {}
        self.busy: set[int] = set()
        self.stepped = False
        self.rank_step_s: float | None = None
        self._last_report_at: float | None = None
        self._report_intervals: deque[float] = deque(maxlen=REPORT_INTERVALS_KEPT)
        self.probe_started_at: float | None = None
        self.asked: set[int] = set()
        self.answers: dict[int, protocol.Stacks] = {}

    # -- progress ------------------------------------------------------------------------------

    def saw_progress(self) -> None:
        """A rank got something done now (and any alarm is off)."""
        self.last_progress_at = self.clock()
        if self.probe_started_at is not None:
            self.probe_started_at = None
            self.asked.clear()
            self.answers.clear()

    def progress(self, message: protocol.Progress) -> None:
        """A rank's progress message."""
        changed = self.work.get(message.rank) != message.work or (message.rank in self.busy) != message.busy
        self.work[message.rank] = message.work
        if message.busy:
            self.busy.add(message.rank)
        else:
            self.busy.discard(message.rank)
        self.stepped = self.stepped or message.steps > 0
        if message.step_s is not None:
            self.rank_step_s = message.step_s
        if changed:
            self.saw_progress()

    def rank_ended(self, rank: int) -> None:
        """``rank``'s train function ended (or its process did): its last word on long work is void."""
        self.busy.discard(rank)

    def report_done(self) -> None:
        """Every rank made a report: with no step counted, report intervals stand for steps."""
        now = self.clock()
        if self._last_report_at is not None:
            self._report_intervals.append(now - self._last_report_at)
            self.stepped = True
        self._last_report_at = now
        self.saw_progress()

    @property
    def step_s(self) -> float | None:
        """The median recent step time: the ranks' own, else of the intervals between reports."""
        if self.rank_step_s is not None:
            return self.rank_step_s
        return statistics.median(self._report_intervals) if self._report_intervals else None

    # -- the alarm -----------------------------------------------------------------------------

    def threshold_s(self) -> float | None:
        """The time without progress that is a hang now (None: no hang can be named now)."""
        return self.rule.threshold_s(self.stepped, self.step_s)

    def quiet_s(self) -> float:
        """Seconds since any rank made progress."""
        return self.clock() - self.last_progress_at

    def time_to_deadline(self) -> float | None:
        """Seconds until the watch has something to do: the end of its probe, or the threshold
        (while a rank is in lockstep's own long work, the longer busy limit; None when no
        threshold applies)."""
        now = self.clock()
        if self.probe_started_at is not None:
            return max(0.0, self.probe_started_at + PROBE_WAIT_S - now)
        threshold = self.threshold_s()
        if threshold is not None and self.busy:
            limit = self.rule.busy_limit_s
            threshold = None if limit is None else max(threshold, limit)
        if threshold is None:
            return None
        return max(0.0, self.last_progress_at + threshold - now)

    def due(self) -> bool:
        """Whether a hang is suspected now and the ranks should be asked where they are."""
        return self.probe_started_at is None and self.time_to_deadline() == 0.0

    def start_probe(self, ranks: list[int]) -> None:
        """The ranks ``ranks`` were asked where they are."""
        self.probe_started_at = self.clock()
        self.asked = set(ranks)
        self.answers.clear()

    def answered(self, stacks: protocol.Stacks) -> None:
        """A rank said where it is."""
        if self.probe_started_at is not None and stacks.rank in self.asked:
            self.answers[stacks.rank] = stacks

    def probe_over(self) -> bool:
        """Whether every rank asked has answered, or the probe's time is up: the hang stands."""
        if self.probe_started_at is None:
            return False
        return len(self.answers) >= len(self.asked) or self.clock() >= self.probe_started_at + PROBE_WAIT_S
