"""Counts of storage operations tried again, in this process, for the metrics exporter
(``lockstep_storage_retries_total``). Code that retries a storage operation calls
:func:`count_retry` once per retry; counting costs a lock and a dictionary write, and needs no
optional package. A rank's retries are counted in the rank's own process (not exported)."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts: dict[str, int] = {}


def count_retry(operation: str) -> None:
    """One more retry of ``operation`` (a short fixed name, e.g. ``"write_record"``: it becomes
    a label value, so never put a path or an error text in it)."""
    with _lock:
        _counts[operation] = _counts.get(operation, 0) + 1


def retry_counts() -> dict[str, int]:
    """The retries so far in this process, by operation."""
    with _lock:
        return dict(_counts)
