"""A run's status as a reader shows it: the record's own, except ``lost`` for a run the record
says is running whose driver is gone.

Two signs of a gone driver: on the driver's own host, its process no longer runs (killed with
SIGKILL, or the machine restarted); on any host, the record's heartbeat (``heartbeat_at``, which
the driver rewrites at least every ``heartbeat_interval_s``) is older than
:data:`LOST_AFTER_BEATS` intervals plus :data:`CLOCK_SLACK_S` (the reader's clock may differ a
little from the driver's). A record written before heartbeats existed is judged by the first
sign only.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

#: The statuses a run record can hold, and ``lost``.
STATUSES = ("running", "finished", "failed", "interrupted", "preempted", "pruned", "stopped", "lost")
LOST_AFTER_BEATS = 3
CLOCK_SLACK_S = 30.0


def shown_status(record: dict[str, Any], now: float | None = None) -> str:
    """The run's status (see the module's docstring); ``now`` is the reader's Unix time."""
    status = str(record.get("status", "?"))
    if status != "running":
        return status
    driver = record.get("driver") or {}
    if driver.get("host") == socket.gethostname() and not process_alive(driver.get("pid")):
        return "lost"
    beat, interval = record.get("heartbeat_at"), record.get("heartbeat_interval_s")
    if isinstance(beat, (int, float)) and isinstance(interval, (int, float)):
        silent_s = (time.time() if now is None else now) - beat
        if silent_s > LOST_AFTER_BEATS * interval + CLOCK_SLACK_S:
            return "lost"
    return status


def process_alive(pid: Any) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return True  # nothing to check against: don't call it lost
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = stat_fields(pid)
    return fields is None or fields[0] != "Z"  # a zombie runs no code


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on (``[0]`` the state, ``[19]`` the
    start time in clock ticks since boot), or None when it can't be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
