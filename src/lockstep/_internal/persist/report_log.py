"""The run's report history, ``reports.jsonl``: appended line by line on local disk, rewritten
whole (from a thread, so a report never waits for the object store) on other filesystems.
Writes are retried through the run's :class:`~lockstep._internal.persist.retry.StorageRetry`,
and a retried write never records a report twice: a rewrite replaces the whole file, and a
failed append is cut back to the last whole line before it is tried again."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import fsspec

from lockstep._internal.persist.retry import StorageRetry

logger = logging.getLogger(__name__)


def complete_lines(handle: Any) -> Iterator[str]:
    for line in handle:
        if line.endswith("\n"):
            yield line


class ReportLog:
    """``reports.jsonl``: one line per committed report."""

    def append(self, line: str) -> None:
        """Add one JSON line."""
        raise NotImplementedError

    def close(self) -> None:
        """Write out everything appended so far."""

    def flush(self) -> None:
        """Return once every line appended so far is in storage (before a record write names a
        checkpoint, so that the record never counts a report the history lacks)."""


class AppendingReportLog(ReportLog):
    """On local disk: each line is appended at once (one ``write``, microseconds)."""

    def __init__(self, path: str, retry: StorageRetry | None = None) -> None:
        self.path = path
        self.retry = retry or StorageRetry()
        self._fd: int | None = None

    def append(self, line: str) -> None:
        data = (line + "\n").encode()
        self.retry.call("write_reports", self.path, lambda: self._append(data), lambda: len(data))

    def _append(self, data: bytes) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            _cut_torn_tail(self._fd, self.path)
        whole = os.fstat(self._fd).st_size
        left = memoryview(data)
        try:
            while left:
                left = left[os.write(self._fd, left) :]
        except OSError:
            os.ftruncate(self._fd, whole)  # no torn line stays for the retry to append after
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _cut_torn_tail(fd: int, path: str) -> None:
    """Cut a torn last line (a write a crash stopped short) off the file, so the next line does
    not join it: readers skip a torn last line, but not a whole line that isn't JSON."""
    size = end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            end = start + newline + 1
            break
        end = start
    if end < size:
        logger.warning("cut a torn last line (%d bytes, from a crash) off the report history %s", size - end, path)
        os.ftruncate(fd, end)


_TAIL_CHUNK = 1 << 16


class RewritingReportLog(ReportLog):
    """On object stores, which can't append: a background thread rewrites the whole file
    whenever lines were added, so ``report()`` never waits for a round trip to the store.

    A rewrite that fails (past the retry bound, or with a permanent error) is tried again with the
    next line; until one succeeds, :meth:`flush` and :meth:`close` raise its error, so that no
    record names a report the history lacks and a run whose history is lost does not end as if
    it were kept."""

    def __init__(
        self,
        filesystem: fsspec.AbstractFileSystem,
        path: str,
        existing_lines: list[str],
        retry: StorageRetry | None = None,
    ) -> None:
        self.filesystem = filesystem
        self.path = path
        self.retry = retry or StorageRetry()
        self._lines = list(existing_lines)
        self._written = len(existing_lines)
        self._failure: tuple[int, Exception] | None = None  # the lines a rewrite last failed to write, and why
        self._changed = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def append(self, line: str) -> None:
        with self._changed:
            self._lines.append(line)
            self._changed.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="lockstep-report-log", daemon=True)
            self._thread.start()

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                while not self._closing and not self._due():
                    self._changed.wait()
                if self._closing:
                    return
                lines = list(self._lines)
            self._write(lines)

    def _due(self) -> bool:
        """Whether lines wait that no rewrite has failed on yet (call with the lock held)."""
        count = len(self._lines)
        return count > self._written and (self._failure is None or self._failure[0] != count)

    def _write(self, lines: list[str]) -> None:
        data = "".join(line + "\n" for line in lines).encode()
        try:
            shown = self.filesystem.unstrip_protocol(self.path)
            self.retry.call("write_reports", shown, lambda: self.filesystem.pipe_file(self.path, data))
        except Exception as error:  # noqa: BLE001 - kept for flush() and close(); training goes on meanwhile
            logger.warning("could not write the report history %s: %s", self.path, error)
            with self._changed:
                self._failure = (len(lines), error)
                self._changed.notify_all()
            return
        with self._changed:
            self._written = max(self._written, len(lines))
            self._failure = None
            self._changed.notify_all()

    def flush(self) -> None:
        with self._changed:
            wanted = len(self._lines)
            while self._written < wanted and self._thread is not None and self._thread.is_alive():
                if self._failure is not None and self._failure[0] >= wanted:
                    raise self._failure[1]
                self._changed.wait()

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if len(self._lines) != self._written:
            self._write(list(self._lines))
            if self._failure is not None:
                raise self._failure[1]
