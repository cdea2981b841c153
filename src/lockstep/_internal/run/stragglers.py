"""Naming the slow rank: the driver's reading of the per-rank step times that ranks send with
each report (see :mod:`lockstep._internal.rank.step_timing`).

In a synchronous data-parallel run every rank's time between two reports is about the same,
because the ranks wait for each other (in DDP's all-reduce, in ``report()``). What differs is
how much of it a rank spends on its own work, **busy = data wait + compute** (its time less
its waits for the other ranks). A rank that takes longer to load its data or to compute makes
the others wait; its busy time is the largest.

The rule, over the last :data:`RECENT_REPORTS` reports that carry step times:

* in one report, rank r is *slow* when its busy time is at least :data:`SLOW_RATIO` times the
  median busy time of the other ranks, and the difference is at least :data:`MIN_GAP_SHARE` of
  its time between the reports (so microsecond jitter on an idle loop names nobody);
* a rank is *the slowest* when it was slow in at least :data:`CONSISTENT_SHARE` of those
  reports, and there were at least :data:`MIN_REPORTS` of them.

Its cause is data loading or compute: the one whose share of its time exceeds the other ranks'
median share by more (not its largest share: a rank slow to load spends the same on compute as
the others, and its compute share may still be the largest). A balanced run names nobody.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: How many of the latest reports the rule looks at.
RECENT_REPORTS = 6
#: Fewer reports with step times than this: too early to name anyone.
MIN_REPORTS = 3
#: Busy at least this many times the other ranks' median, in one report.
SLOW_RATIO = 1.25
#: ... and busier by at least this share of its time between the reports.
MIN_GAP_SHARE = 0.10
#: Slow in at least this share of the recent reports.
CONSISTENT_SHARE = 0.8

#: The history keeps every report's step times up to this many ranks; past it, every few reports'.
STEP_TIMES_KEPT_RANKS = 64

#: The parts of a rank's time, in the order ``lockstep show`` prints them.
PARTS = ("data", "collective", "report", "compute")
CAUSES = {"data": "data loading", "compute": "compute"}

#: One rank's step times as the run history keeps them (seconds; see StepTimes).
RankTimes = Mapping[str, float]


@dataclass(frozen=True)
class SlowRank:
    """The rank that held the others back, and why."""

    rank: int
    cause: str
    share: float

    def describe(self) -> str:
        """E.g. ``rank 1 — data loading, 71% of its step time``."""
        return f"rank {self.rank} — {CAUSES[self.cause]}, {self.share:.0%} of its step time"

    def short(self) -> str:
        """E.g. ``rank 1 (data)`` for the progress line."""
        return f"rank {self.rank} ({self.cause})"


def times_record(calls: Mapping[int, Any]) -> dict[str, dict[str, float]] | None:
    """The ranks' StepTimes of one report (``calls``: rank -> protocol.Report) as the run history
    stores them, ``{"0": {"window": s, "data": s, ...}}``; None when no rank sent any."""
    step_times = {rank: call.step_times for rank, call in calls.items() if call.step_times is not None}
    if not step_times:
        return None
    return {
        str(rank): {
            "window": round(times.window_s, 6),
            "data": round(times.data_s, 6),
            "collective": round(times.collective_s, 6),
            "report": round(times.report_s, 6),
        }
        for rank, times in sorted(step_times.items())
    }


def keeps_step_times(index: int, ranks: int) -> bool:
    """Whether the run history keeps report ``index``'s per-rank step times: always up to
    :data:`STEP_TIMES_KEPT_RANKS` ranks, else every ``ranks / STEP_TIMES_KEPT_RANKS``-th report,
    so the history grows by about as much per report at 1,000 ranks as at 64 (the driver's
    slow-rank rule sees every report either way)."""
    every = -(-ranks // STEP_TIMES_KEPT_RANKS)
    return index % every == 0


def parts_of(times: RankTimes) -> dict[str, float]:
    """Seconds in each of :data:`PARTS` (compute: the rest of the window)."""
    waits = {part: float(times.get(part, 0.0)) for part in ("data", "collective", "report")}
    return {**waits, "compute": max(0.0, float(times.get("window", 0.0)) - sum(waits.values()))}


def busy(times: RankTimes) -> float:
    """The rank's own work: data wait plus compute (the window less the waits for other ranks)."""
    data = float(times.get("data", 0.0))
    waits = data + float(times.get("collective", 0.0)) + float(times.get("report", 0.0))
    return data + max(0.0, float(times.get("window", 0.0)) - waits)


def slow_in(report_times: Mapping[str, RankTimes]) -> int | None:
    """The rank that was slow in one report, by the rule above, or None."""
    if len(report_times) < 2:
        return None
    loads = {int(rank): busy(times) for rank, times in report_times.items()}
    rank = max(loads, key=loads.__getitem__)
    others = statistics.median(load for other, load in loads.items() if other != rank)
    window = float(report_times[str(rank)].get("window", 0.0))
    if window <= 0 or loads[rank] < SLOW_RATIO * others or loads[rank] - others < MIN_GAP_SHARE * window:
        return None
    return rank


def recent_times(reports: Sequence[Mapping[str, Any]]) -> list[Mapping[str, RankTimes]]:
    """The step times of the last :data:`RECENT_REPORTS` reports that have them (records written
    before step times existed have none)."""
    timed: list[Mapping[str, RankTimes]] = []
    for report in reversed(reports):
        if len(timed) == RECENT_REPORTS:
            break
        if report.get("step_times"):
            timed.append(report["step_times"])
    return timed[::-1]


def slowest_rank(recent: Sequence[Mapping[str, RankTimes]]) -> SlowRank | None:
    """The consistently slow rank, from the step times of the latest reports (as
    :func:`recent_times` picks them), or None."""
    recent = list(recent)[-RECENT_REPORTS:]
    return _slowest(recent, [slow_in(times) for times in recent])


def _slowest(recent: Sequence[Mapping[str, RankTimes]], verdicts: Sequence[int | None]) -> SlowRank | None:
    """The rule's verdict over ``recent`` reports, given each one's slow rank (``verdicts``)."""
    if len(recent) < MIN_REPORTS:
        return None
    rank = max(set(verdicts), key=list(verdicts).count)
    if rank is None or list(verdicts).count(rank) < CONSISTENT_SHARE * len(recent):
        return None
    shares = rank_shares(recent)
    cause = cause_of(rank, shares)
    return SlowRank(rank, cause, shares.get(rank, {}).get(cause, 0.0))


class SlowRankWatch:
    """The driver's running reading of the rule, one report at a time: each report's verdict is
    worked out once, when it comes (its cost grows with the ranks, not with the reports kept),
    and the cause only while a rank is consistently slow."""

    def __init__(self) -> None:
        self._recent: deque[Mapping[str, RankTimes]] = deque(maxlen=RECENT_REPORTS)
        self._verdicts: deque[int | None] = deque(maxlen=RECENT_REPORTS)
        self.slowest: SlowRank | None = None

    def add(self, report_times: Mapping[str, RankTimes]) -> SlowRank | None:
        """Take the next report's step times; the slowest rank now (None when the ranks are balanced)."""
        self._recent.append(report_times)
        self._verdicts.append(slow_in(report_times))
        self.slowest = _slowest(self._recent, self._verdicts)
        return self.slowest


def cause_of(rank: int, shares: Mapping[int, Mapping[str, float]]) -> str:
    """The part of :data:`CAUSES` in which ``rank``'s share exceeds the other ranks' median share the most."""
    own = shares.get(rank, {})
    others = [times for other, times in shares.items() if other != rank]

    def excess(part: str) -> float:
        return own.get(part, 0.0) - (statistics.median(times.get(part, 0.0) for times in others) if others else 0.0)

    return max(CAUSES, key=excess)


def rank_shares(recent: Sequence[Mapping[str, RankTimes]]) -> dict[int, dict[str, float]]:
    """Per rank, the share of its time in each of :data:`PARTS` over ``recent`` reports, and
    ``step_s``: its mean time between reports."""
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for report_times in recent:
        for rank_name, times in report_times.items():
            total = sums.setdefault(int(rank_name), dict.fromkeys(PARTS, 0.0))
            for part, seconds in parts_of(times).items():
                total[part] += seconds
            counts[int(rank_name)] = counts.get(int(rank_name), 0) + 1
    shares: dict[int, dict[str, float]] = {}
    for rank, total in sorted(sums.items()):
        window = sum(total.values())
        shares[rank] = {part: (seconds / window if window > 0 else 0.0) for part, seconds in total.items()}
        shares[rank]["step_s"] = window / counts[rank]
    return shares


def rank_table(reports: Sequence[Mapping[str, Any]]) -> list[str]:
    """The lines ``lockstep show`` prints: a per-rank table of where the time went over the
    recent reports, and the slowest rank when there is one; nothing without step times."""
    recent = recent_times(reports)
    if not recent:
        return []
    shares = rank_shares(recent)
    slow = slowest_rank(recent)
    rows: list[tuple[str, ...]] = [("RANK", "DATA", "COLLECTIVE", "REPORT WAIT", "COMPUTE", "TIME/REPORT")]
    rows += _folded_rows(shares, slow) if len(shares) > TABLE_RANKS else [_row(str(r), s) for r, s in shares.items()]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [f"time per rank, last {len(recent)} reports (shares of the time between reports):"]
    lines += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.append(f"slowest: {slow.describe()}" if slow else "slowest: none (the ranks are balanced)")
    return lines


#: More ranks than this: ``lockstep show`` folds its table into summary rows.
TABLE_RANKS = 16


def _row(label: str, shares: Mapping[str, float]) -> tuple[str, ...]:
    return (label, *(f"{shares[part]:.0%}" for part in PARTS), f"{shares['step_s']:.3f}s")


def _folded_rows(shares: Mapping[int, Mapping[str, float]], slow: SlowRank | None) -> list[tuple[str, ...]]:
    """The table of many ranks in a few rows: the median, lowest and highest of each column over
    all ranks, then the ranks that stand out (the slowest, and the rank with the most time of its
    own, busy = data + compute)."""
    columns = [*PARTS, "step_s"]
    values = {column: sorted(rank_values[column] for rank_values in shares.values()) for column in columns}
    rows = [
        _row(f"median of {len(shares)}", {column: statistics.median(values[column]) for column in columns}),
        _row("lowest", {column: values[column][0] for column in columns}),
        _row("highest", {column: values[column][-1] for column in columns}),
    ]
    busiest = max(shares, key=lambda rank: shares[rank]["data"] + shares[rank]["compute"])
    standing_out = dict.fromkeys([*([slow.rank] if slow else []), busiest])
    rows += [_row(f"rank {rank}", shares[rank]) for rank in standing_out if rank in shares]
    return rows
