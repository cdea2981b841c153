"""The storage outages a run rode out, as its record keeps them (``storage_outages``) and
``lockstep show`` prints them.

Every process of a run (the driver, each rank) retries its own storage operations and sees an
outage on its own (see :mod:`lockstep._internal.persist.retry`); the record merges what they saw
into one entry per outage: the same outage seen by the driver and two ranks overlaps in time,
so it is counted once, its time lost once (the union of what each saw), its retries summed::

    "storage_outages": {"count": 1, "lost_s": 15.8, "retries": 23,
                        "recent": [{"started_at": 1764682800.1, "lasted_s": 15.8, "retries": 23,
                                    "seen_by": ["driver", "rank 0", "rank 1"]}]}

The record keeps the latest :data:`RECENT_KEPT` outages; the totals count them all, across the
runs continued under the same name.
"""

from __future__ import annotations

from typing import Any

from lockstep._internal.persist.retry import Outage

__all__ = ["RECORD_KEY", "add_outage", "outages_line"]

RECORD_KEY = "storage_outages"
RECENT_KEPT = 20
#: Outages seen by two processes this close (in seconds) are one: each notices the start and
#: the end of an outage at its own next attempt.
SLACK_S = 1.0


def add_outage(kept: dict[str, Any] | None, outage: Outage, seen_by: str) -> dict[str, Any]:
    """The record's ``storage_outages`` with ``outage`` (seen by ``seen_by``: "driver" or
    "rank <r>") added: merged with the outages it overlaps, or as a new one. Returns a new dict."""
    kept = kept or {"count": 0, "lost_s": 0.0, "retries": 0, "recent": []}
    start, end = outage.started_at, outage.started_at + outage.lasted_s
    recent = list(kept["recent"])
    overlapping = [entry for entry in recent if _start(entry) <= end + SLACK_S and start <= _end(entry) + SLACK_S]
    merged_start = min([start, *map(_start, overlapping)])
    merged_end = max([end, *map(_end, overlapping)])
    merged = {
        "started_at": round(merged_start, 3),
        "lasted_s": round(merged_end - merged_start, 3),
        "retries": outage.retries + sum(entry["retries"] for entry in overlapping),
        "seen_by": sorted({seen_by, *(who for entry in overlapping for who in entry["seen_by"])}, key=_rank_order),
    }
    recent = sorted([entry for entry in recent if entry not in overlapping] + [merged], key=_start)
    return {
        "count": kept["count"] + 1 - len(overlapping),
        "lost_s": round(kept["lost_s"] + (merged_end - merged_start) - sum(map(_length, overlapping)), 3),
        "retries": kept["retries"] + outage.retries,
        "recent": recent[-RECENT_KEPT:],
    }


def outages_line(record: dict[str, Any]) -> str | None:
    """What ``lockstep show`` says of the run's storage outages (None when it had none)."""
    kept = record.get(RECORD_KEY)
    if not kept or not kept.get("count"):
        return None
    count = kept["count"]
    return (
        f"{count} outage{'s' if count != 1 else ''} ridden out, {kept['lost_s']:.1f} s lost ({kept['retries']} retries)"
    )


def _start(entry: dict[str, Any]) -> float:
    return float(entry["started_at"])


def _end(entry: dict[str, Any]) -> float:
    return float(entry["started_at"]) + float(entry["lasted_s"])


def _length(entry: dict[str, Any]) -> float:
    return float(entry["lasted_s"])


def _rank_order(who: str) -> tuple[int, int]:
    """ "driver" first, then the ranks in order."""
    return (0, 0) if who == "driver" else (1, int(who.rsplit(" ", 1)[-1]))
