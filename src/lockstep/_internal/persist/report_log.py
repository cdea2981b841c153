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
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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


class RewritingReportLog(ReportLog):
    """On object stores, which can't append: a background thread rewrites the whole file
    whenever lines were added, so ``report()`` never waits for a round trip to the store."""

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
                while len(self._lines) == self._written and not self._closing:
                    self._changed.wait()
                if len(self._lines) == self._written:
                    return
                lines = list(self._lines)
            self._write(lines)

    def _write(self, lines: list[str]) -> None:
        data = "".join(line + "\n" for line in lines).encode()
        try:
            shown = self.filesystem.unstrip_protocol(self.path)
            self.retry.call("write_reports", shown, lambda: self.filesystem.pipe_file(self.path, data))
        except Exception as error:  # noqa: BLE001 - a lost history write must not stop training
            logger.warning("could not write the report history %s: %s", self.path, error)
        with self._changed:
            self._written = len(lines)
            self._changed.notify_all()

    def flush(self) -> None:
        with self._changed:
            wanted = len(self._lines)
            while self._written < wanted and self._thread is not None and self._thread.is_alive():
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
