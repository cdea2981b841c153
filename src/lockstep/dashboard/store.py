"""What the dashboard reads, through lockstep's storage layer (a local folder or any fsspec URI
such as ``s3://bucket/prefix``): the runs under a storage path, their records, their report
histories (kept and read incrementally, see :mod:`lockstep.dashboard.history`), the tails of
their logs and the sizes of their checkpoints. It only reads; it never talks to a run's driver or
ranks.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from lockstep._internal.console_lines import shown_lines
from lockstep._internal.persist.filesystems import join, resolve_filesystem
from lockstep._internal.persist.storage import RunStorage
from lockstep.dashboard.history import ReportHistory

__all__ = ["RunStore", "UnknownRun"]

#: How many runs' report histories are kept in memory at least (the least recently viewed go first;
#: as many as the runs list shows, when it shows more, or every poll of the list would read each
#: history from its start).
KEPT_HISTORIES = 64
#: How much of the end of each log file a run page shows.
LOG_TAIL_BYTES = 64 * 1024
LOG_TAIL_LINES = 200


class UnknownRun(LookupError):
    """No run of that name under the storage path."""


class RunStore:
    """The runs under ``storage_path``.

    Args:
        storage_path: A local folder or a URI (``s3://bucket/prefix``).
        filesystem: An fsspec filesystem to read it with (default: from the path).
    """

    def __init__(self, storage_path: str, filesystem: Any = None) -> None:
        self.storage_path = storage_path
        self.filesystem, self.root = resolve_filesystem(storage_path, filesystem)
        self._histories: collections.OrderedDict[str, ReportHistory] = collections.OrderedDict()
        self._runs_listed = 0  # the runs list touches every history: keep at least that many
        self._sizes: dict[str, int | None] = {}
        self._lock = threading.Lock()

    def run_names(self) -> list[str]:
        """The names of the folders directly under the storage path (those without a run record
        are left out by :meth:`records`)."""
        self.filesystem.invalidate_cache(self.root)
        if not self.filesystem.isdir(self.root):
            return []
        entries = self.filesystem.ls(self.root, detail=True)
        return sorted(entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory")

    def records(self) -> dict[str, dict[str, Any]]:
        """Every run's record, by run name."""
        found = {}
        for name in self.run_names():
            record = self.run(name).read_record()
            if record is not None:
                found[name] = record
        self._runs_listed = len(found)
        return found

    def run(self, name: str) -> RunStorage:
        """The run folder of ``name``.

        Raises:
            UnknownRun: ``name`` is not a plain folder name.
        """
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise UnknownRun(name)
        return RunStorage(join(self.root, name), self.filesystem)

    def record(self, name: str) -> dict[str, Any]:
        """The record of run ``name``, read now.

        Raises:
            UnknownRun: there is no such run.
        """
        record = self.run(name).read_record()
        if record is None:
            raise UnknownRun(name)
        return record

    def history(self, name: str, record: dict[str, Any] | None = None) -> ReportHistory:
        """The report history of run ``name``, brought up to date (read anew when ``record``, the
        run's record, says the run was created anew since)."""
        with self._lock:
            history = self._histories.pop(name, None) or ReportHistory(self.run(name))
            self._histories[name] = history
            while len(self._histories) > max(KEPT_HISTORIES, self._runs_listed):
                self._histories.popitem(last=False)
        history.refresh(record.get("created_at") if record else None)
        return history

    def checkpoint_size(self, name: str, dir_name: str, external_path: str | None = None) -> int | None:
        """The bytes of a committed checkpoint (its folder in the run, or ``external_path`` for
        one registered where it was); None when it can't be read. Committed checkpoints don't
        change, so each is measured once."""
        key = external_path or f"{name}/{dir_name}"
        if key not in self._sizes:
            try:
                if external_path is None:
                    filesystem, path = self.filesystem, self.run(name).path_of(dir_name)
                else:
                    filesystem, path = resolve_filesystem(external_path)
                self._sizes[key] = int(filesystem.du(path, total=True))
            except (OSError, ValueError):
                self._sizes[key] = None
        return self._sizes[key]

    def log_tails(self, name: str) -> dict[str, str]:
        """The last lines of each file in the run's ``logs/`` folder, by file name."""
        folder = self.run(name).path_of("logs")
        self.filesystem.invalidate_cache(folder)
        try:
            entries = self.filesystem.ls(folder, detail=True)
        except FileNotFoundError:
            return {}
        tails = {}
        for entry in sorted(entries, key=lambda item: _log_order(item["name"])):
            if entry["type"] == "file":
                tails[entry["name"].rsplit("/", 1)[-1]] = self._tail(entry["name"], int(entry.get("size") or 0))
        return tails

    def _tail(self, path: str, size: int) -> str:
        start = max(0, size - LOG_TAIL_BYTES)
        with self.filesystem.open(path, "rb") as handle:
            handle.seek(start)
            data = handle.read(size - start)
        lines = shown_lines(data.decode("utf-8", errors="replace"))
        if start > 0:
            lines = lines[1:]  # the first line is cut
        return "\n".join(lines[-LOG_TAIL_LINES:])


def _log_order(path: str) -> tuple[int, str]:
    """Rank logs first, in rank order, then the other files by name."""
    name = path.rsplit("/", 1)[-1]
    stem = name.removesuffix(".log")
    if stem.startswith("rank_") and stem[5:].isdigit():
        return (int(stem[5:]), name)
    return (1 << 30, name)
