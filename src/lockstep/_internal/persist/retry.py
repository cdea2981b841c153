"""Riding out storage outages: every storage operation of a run (checkpoint files written or read,
the run record and the report history written or read, checkpoints deleted) goes through
:meth:`StorageRetry.call`, which retries it while its errors are transient (see
:mod:`lockstep._internal.persist.fault_kinds`), with exponential backoff and jitter, for up to
``RunConfig.storage_retry_s`` from its first failed attempt. The client libraries' own retries
(botocore's, pyarrow's) stay underneath: lockstep's bounds the total time.

- A permanent error (no such bucket, access denied, not found) is raised at once, unchanged.
- A full disk or quota (``ENOSPC``, ``EDQUOT``) is never retried: it becomes a
  :class:`~lockstep.errors.StorageFullError` that says where, and how much was needed.
- An operation still failing when the bound runs out raises
  :class:`~lockstep.errors.StorageUnreachableError`, saying for how long, where, and how to
  raise the bound.

Only operations that are safe to repeat go through here: whole-file writes (the record, the
report history on object stores, one checkpoint file), reads and deletions; an append to the
report history on local disk first cuts the file back to its last whole line.

An outage, in one process, begins with the first failed operation and ends when no operation is
failing any more: one WARNING line when it begins and one when it ends (however many retries it
took), each retry counted for the metrics (:func:`count_retry`), and the outage handed to
``on_outage_end`` (the driver puts it in the run record; a rank sends it to the driver). An
operation that failed because it began before the last outage ended joins no new outage.
While a storage operation goes on (tried, retried, waited for) on a rank, the rank is making
progress for the hang detector (each operation is wrapped in the marker :func:`mark_waits_with`
sets): the client library's own retries inside one attempt can take seconds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from lockstep._internal.persist.fault_kinds import FaultKind, classify
from lockstep._internal.persist.retry_counts import count_retry
from lockstep.errors import StorageFullError, StorageUnreachableError

__all__ = ["DEFAULT_RETRY_S", "Outage", "StorageRetry", "mark_waits_with"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: ``RunConfig.storage_retry_s``'s default: five minutes.
DEFAULT_RETRY_S = 300.0
#: The first wait before a retry; each further one doubles, up to MAX_DELAY_S.
FIRST_DELAY_S = 0.2
MAX_DELAY_S = 5.0

#: What each operation does, for messages (the keys are the metrics' labels).
OPERATIONS = {
    "upload_checkpoint": "writing checkpoint files",
    "download_checkpoint": "reading checkpoint files",
    "delete_checkpoint": "deleting a checkpoint",
    "upload_logs": "copying the workers' logs",
    "download_logs": "reading the workers' earlier logs",
    "write_record": "writing the run record",
    "read_record": "reading the run record",
    "write_reports": "writing the report history",
    "read_reports": "reading the report history",
}

_wait_marker: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def mark_waits_with(marker: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """Wrap every retrying operation of this process in ``marker()`` (a rank passes
    ``PROGRESS.making_progress``, so that a rank riding out an outage is not named hung)."""
    global _wait_marker
    _wait_marker = marker


@dataclass(frozen=True)
class Outage:
    """One outage as a process saw it: when it began (wall time, seconds since the epoch), how
    long it lasted, how many retries it took."""

    started_at: float
    lasted_s: float
    retries: int


@dataclass(frozen=True)
class _Operation:
    """One storage operation, as messages name it."""

    name: str
    where: str
    needed_bytes: Callable[[], int] | None = None

    @property
    def phrase(self) -> str:
        return OPERATIONS.get(self.name, self.name)


class StorageRetry:
    """The retrying of one run's storage operations in this process, and the outages seen.

    Picklable (a copy starts with no outage and no ``on_outage_end``): the driver's run storage
    carries it to the ranks.

    Args:
        limit_s: How long an operation is retried from its first failed attempt (0: never).
        on_outage_end: Called with each outage once it is over (from the thread that ended it).
    """

    def __init__(self, limit_s: float = DEFAULT_RETRY_S, on_outage_end: Callable[[Outage], None] | None = None) -> None:
        self.limit_s = float(limit_s)
        self.on_outage_end = on_outage_end
        self._lock = threading.Lock()
        self._failing = 0
        self._started: float | None = None  # time.monotonic() of the outage going on
        self._retries = 0
        self._last_end = -math.inf

    def __getstate__(self) -> dict[str, float]:
        return {"limit_s": self.limit_s}

    def __setstate__(self, state: dict[str, float]) -> None:
        self.__init__(state["limit_s"])  # type: ignore[misc]

    def call(
        self, operation: str, where: str, action: Callable[[], T], needed_bytes: Callable[[], int] | None = None
    ) -> T:
        """``action()``, retried while it fails with transient errors (see the module's docstring).

        Args:
            operation: One of :data:`OPERATIONS` (a metrics label and a phrase for messages).
            where: The path or URI it works on, for messages.
            action: The operation; it must be safe to repeat.
            needed_bytes: How many bytes it writes, for the message of a full storage.

        Raises:
            StorageFullError: no space left.
            StorageUnreachableError: still failing with transient errors after ``limit_s``.
            Exception: a permanent error, as ``action`` raised it.
        """
        started = time.monotonic()
        with _wait_marker():  # the client library's own retries, inside the first attempt, take time too
            try:
                return action()
            except Exception as error:  # noqa: BLE001 - classified below: only transient ones are retried
                failure = error
            return self._retry(_Operation(operation, where, needed_bytes), action, failure, started)

    def _retry(self, operation: _Operation, action: Callable[[], T], failure: Exception, started: float) -> T:
        self._raise_unless_transient(failure, operation)
        recovered = False
        with self._lock:
            self._failing += 1
        try:
            result = self._retry_loop(operation, action, failure, started)
            recovered = True
            return result
        finally:
            self._leave(recovered)

    def _retry_loop(self, operation: _Operation, action: Callable[[], T], failure: Exception, started: float) -> T:
        attempt_started, delay = started, FIRST_DELAY_S
        while True:
            self._note_failure(operation, failure, attempt_started)
            waited = time.monotonic() - started
            if waited >= self.limit_s:
                raise StorageUnreachableError(self._unreachable_message(operation, failure, waited)) from failure
            time.sleep(min(delay / 2 + random.uniform(0, delay / 2), self.limit_s - waited))
            count_retry(operation.name)
            with self._lock:
                self._retries += 1
            attempt_started, delay = time.monotonic(), min(delay * 2, MAX_DELAY_S)
            try:
                return action()
            except Exception as error:  # noqa: BLE001 - classified: only transient ones go round again
                self._raise_unless_transient(error, operation)
                failure = error

    def _raise_unless_transient(self, error: Exception, operation: _Operation) -> None:
        kind = classify(error)
        if kind is FaultKind.FULL:
            raise StorageFullError(
                full_message(operation.name, operation.where, error, operation.needed_bytes)
            ) from error
        if kind is FaultKind.PERMANENT or self.limit_s <= 0:
            raise error

    # -- outages ----------------------------------------------------------------------------------

    def _note_failure(self, operation: _Operation, error: Exception, attempt_started: float) -> None:
        """A failed attempt that began at ``attempt_started``: the start of an outage, unless one
        is going on or the attempt began before the last one ended."""
        with self._lock:
            if self._started is not None or attempt_started < self._last_end:
                return
            self._started, self._retries = attempt_started, 0
        logger.warning(
            "Storage unreachable: %s at %s failed (%s: %s). Retrying for up to %g s (RunConfig.storage_retry_s).",
            operation.phrase,
            operation.where,
            type(error).__name__,
            error,
            self.limit_s,
        )

    def _leave(self, recovered: bool) -> None:
        """An operation stopped failing; the last one to stop ends the outage."""
        with self._lock:
            self._failing -= 1
            if self._failing or self._started is None:
                return
            now = time.monotonic()
            outage = Outage(time.time() - (now - self._started), now - self._started, self._retries)
            self._started, self._last_end = None, now
        if recovered:
            logger.warning("Storage reachable again after %.1f s (%d retries).", outage.lasted_s, outage.retries)
        else:
            logger.warning("Storage still unreachable after %.1f s: giving up.", outage.lasted_s)
        if self.on_outage_end is not None:
            try:
                self.on_outage_end(outage)
            except Exception as error:  # noqa: BLE001 - telling of an outage must not fail the operation
                logger.debug("could not pass on a storage outage: %s", error)

    def _unreachable_message(self, operation: _Operation, error: Exception, waited: float) -> str:
        return (
            f"storage was unreachable for {waited:.0f} s: {operation.phrase} at {operation.where} kept "
            f"failing ({type(error).__name__}: {error}). lockstep retries transient storage errors for up to "
            f"RunConfig(storage_retry_s={self.limit_s:g}); raise it to ride out longer outages, or check that "
            "the storage is up."
        )


def full_message(operation: str, where: str, error: BaseException, needed_bytes: Callable[[], int] | None) -> str:
    """What a :class:`~lockstep.errors.StorageFullError` says: where, what failed, how much was
    needed (and, on a local or mounted filesystem, how much is free), and what to do."""
    needed = None
    if needed_bytes is not None:
        with contextlib.suppress(OSError):
            needed = needed_bytes()
    free = free_bytes(where)
    amounts = [f"what was being written needs {readable_size(needed)}" if needed is not None else ""]
    amounts.append(f"{readable_size(free)} free there now" if free is not None else "")
    said = ", ".join(amount for amount in amounts if amount)
    return (
        f"the storage is full: {OPERATIONS.get(operation, operation)} at {where} failed ({error})"
        f"{f'; {said}' if said else ''}. Free space there (or keep fewer checkpoints with "
        "CheckpointConfig(num_to_keep=...), or choose another storage_path), then run again with the same "
        "RunConfig.name to continue from the run's latest checkpoint."
    )


def free_bytes(path: str) -> int | None:
    """The free space of the local filesystem holding ``path`` (None for a URI)."""
    if "://" in path:
        return None
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def readable_size(size: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    amount, unit = float(size), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if amount < 1024:
            break
        amount, unit = amount / 1024, bigger
    return f"{size} bytes" if unit == "bytes" else f"{amount:.1f} {unit}"
