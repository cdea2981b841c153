"""The run's report history, ``reports.jsonl``: appended line by line on local disk, rewritten
whole (from a thread, so a report never waits for the object store) on other filesystems."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import fsspec

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
    """On local disk: each line is appended and flushed at once (microseconds)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle: Any = None

    def append(self, line: str) -> None:
        if self._handle is None:
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run, closed by close()
        self._handle.write(line + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class RewritingReportLog(ReportLog):
    """On object stores, which can't append: a background thread rewrites the whole file
    whenever lines were added, so ``report()`` never waits for a round trip to the store."""

    def __init__(self, filesystem: fsspec.AbstractFileSystem, path: str, existing_lines: list[str]) -> None:
        self.filesystem = filesystem
        self.path = path
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
        try:
            self.filesystem.pipe_file(self.path, "".join(line + "\n" for line in lines).encode())
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
