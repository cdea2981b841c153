"""The run folder on storage: its layout, the record that makes checkpoints count, the report
history and worker logs (filesystems.py, below it, turns paths and URIs into filesystems).

Run folder layout (``<storage_path>/<name>/``)::

    lockstep_run.json        the run record: status, reports so far, committed checkpoints (oldest
                             first) and which of them are the best, error
    reports.jsonl            one JSON line per report(): report_index, timestamp, metrics, checkpoint
    checkpoint_000003/       checkpoints (every rank's files merged into one folder)
    .lockstep_manifests/     checkpoint_000003.json: each file's size and checksum (manifest.py)

Workers write checkpoint files straight into their folder. A checkpoint counts only once the
run record names it: the driver rewrites the record (a temporary file renamed over the old one
on local disk, a single PUT on object stores) after every rank has finished writing. A folder
the record does not name is an unfinished write: readers ignore it, and the next start of the
run deletes it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.persist import local_logs
from lockstep._internal.persist.filesystems import (
    is_local,
    is_object_store,
    join,
    resolve_filesystem,
    shown_path,
)
from lockstep._internal.persist.manifest import MANIFEST_DIR, FileSum, delete_manifest
from lockstep._internal.persist.report_log import AppendingReportLog, ReportLog, RewritingReportLog, complete_lines
from lockstep._internal.persist.retry import DEFAULT_RETRY_S, StorageRetry
from lockstep._internal.persist.transfer import upload_with_checksums
from lockstep.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

RECORD_FILE = "lockstep_run.json"
REPORTS_FILE = "reports.jsonl"
RESERVED_NAMES = frozenset({RECORD_FILE, REPORTS_FILE, MANIFEST_DIR, "logs"})
RECORD_FORMAT_VERSION = 1
DEFAULT_CHECKPOINT_NAME = re.compile(r"^checkpoint_\d{6,}$")


@contextlib.contextmanager
def storage_errors(storage_path: str) -> Iterator[None]:
    """Turn the errors of an unusable storage_path into a ValueError that says what to fix."""
    try:
        yield
    except ValueError:
        raise
    except FileNotFoundError as error:
        if "://" in storage_path:
            raise ValueError(
                f"storage_path={storage_path!r}: {error}. Check that the bucket exists (create it first) "
                "and that the endpoint (AWS_ENDPOINT_URL) is right."
            ) from error
        raise ValueError(f"storage_path={storage_path!r}: can't create the run folder there ({error}).") from error
    except PermissionError as error:
        if "://" in storage_path:
            raise ValueError(f"storage_path={storage_path!r}: access denied ({error}).{CREDENTIALS_HINT}") from error
        raise ValueError(
            f"storage_path={storage_path!r} is not writable ({error}); choose a folder you can write to."
        ) from error
    except Exception as error:
        hint = _storage_hint(error)
        raise ValueError(
            f"storage_path={storage_path!r} can't be used: {type(error).__name__}: {error}.{hint}"
        ) from error


CREDENTIALS_HINT = (
    " Check the credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a "
    "non-AWS server), or pass RunConfig(storage_filesystem=...) with them."
)


def _storage_hint(error: BaseException) -> str:
    if "credential" in str(error).lower():
        return CREDENTIALS_HINT
    return ""


def check_storage_path(storage_path: str, storage: RunStorage) -> None:
    """Refuse a storage_path that is a file, before anything is written.

    Raises:
        ValueError: the path (or the run folder inside it) is a file.
    """
    filesystem = storage.filesystem
    base = storage.run_path.rsplit("/", 1)[0]
    for path in (base, storage.run_path):
        if filesystem.isfile(path):
            raise ValueError(
                f"storage_path={storage_path!r}: {path} is a file, not a folder; choose a folder for the runs."
            )
    if is_local(filesystem) and os.path.exists(base) and not os.access(base, os.W_OK):
        raise PermissionError(f"{base} is read-only")
    if is_object_store(filesystem):
        bucket = storage.run_path.split("/", 1)[0]
        filesystem.invalidate_cache(bucket)
        try:
            filesystem.ls(bucket, detail=False)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"the bucket {bucket!r} does not exist") from error


@dataclass(frozen=True)
class CheckpointEntry:
    """One committed checkpoint as the run record lists it. ``path`` is set only for a
    checkpoint registered where it already was (NO_UPLOAD), outside the run folder.
    ``validation`` is its validation status (a ``ReportedCheckpointStatus`` value; None when
    no validation was asked for), and ``validation_request`` what ``report(validation=...)``
    asked for, kept while the validation is pending so that a later run can start it again."""

    dir_name: str
    report_index: int
    metrics: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    validation: str | None = None
    validation_request: bool | dict[str, Any] | None = None


class RunStorage:
    """The run folder ``<storage_path>/<name>`` and the operations on it.

    Picklable: the driver creates it, and workers get a copy to write their checkpoint files.
    Every operation on storage is retried through ``retry`` while its errors are transient, for
    up to ``retry_s`` (``RunConfig.storage_retry_s``; see :mod:`lockstep._internal.persist.retry`).
    """

    def __init__(
        self, run_path: str | os.PathLike[str], filesystem: Any = None, retry_s: float = DEFAULT_RETRY_S
    ) -> None:
        self.filesystem, self.run_path = resolve_filesystem(run_path, filesystem)
        self.name = self.run_path.rstrip("/").rsplit("/", 1)[-1]
        self.retry = StorageRetry(retry_s)

    @classmethod
    def for_run(
        cls, storage_path: str, name: str, filesystem: Any = None, retry_s: float = DEFAULT_RETRY_S
    ) -> RunStorage:
        """The run folder ``name`` under ``storage_path``."""
        fs, base = resolve_filesystem(storage_path, filesystem)
        return cls(join(base, name), fs, retry_s)

    @property
    def display_path(self) -> str:
        """The run folder as the user would write it (a URI for remote storage)."""
        if is_local(self.filesystem):
            return self.run_path
        return self.filesystem.unstrip_protocol(self.run_path)

    def path_of(self, *parts: str) -> str:
        """A path inside the run folder."""
        return join(self.run_path, *parts)

    def refresh(self) -> None:
        """Forget cached listings: other processes (workers, an earlier run) write here too."""
        self.filesystem.invalidate_cache(self.run_path)

    # -- checkpoints --------------------------------------------------------------------------

    def checkpoint_path(self, dir_name: str) -> str:
        """Where the checkpoint ``dir_name`` lives."""
        return self.path_of(dir_name)

    def checkpoint_of(self, entry: CheckpointEntry) -> Checkpoint:
        """The Checkpoint a record entry names."""
        if entry.path is not None:
            return Checkpoint(entry.path)._committed()
        return Checkpoint(self.checkpoint_path(entry.dir_name), self.filesystem)._committed()

    def write_checkpoint(self, local_dir: str, dir_name: str) -> list[FileSum] | None:
        """Copy one rank's checkpoint files into the folder of ``dir_name`` (each file retried
        through the run's retry); return each file's relative path, size and checksum (for the
        manifest the commit writes)."""
        return upload_with_checksums(local_dir, self.filesystem, self.checkpoint_path(dir_name), self.retry)

    def delete_checkpoint(self, dir_name: str) -> None:
        """Remove a checkpoint folder (after the record no longer names it)."""
        path = self.checkpoint_path(dir_name)

        def delete() -> None:
            if self.filesystem.exists(path):
                self.filesystem.rm(path, recursive=True)
            delete_manifest(self.filesystem, path)

        self.retry.call("delete_checkpoint", shown_path(self.filesystem, path), delete)

    def checkpoint_folders(self) -> list[str]:
        """The names of the run folder's entries named like lockstep's checkpoints."""
        self.refresh()
        if not self.filesystem.exists(self.run_path):
            return []
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.filesystem.ls(self.run_path, detail=False))
        return sorted(name for name in names if DEFAULT_CHECKPOINT_NAME.match(name))

    def delete_unfinished_checkpoints(self, committed: set[str]) -> list[str]:
        """Delete folders named like lockstep's checkpoints that the record doesn't name
        (writes a crash cut short). Folders with other names are left alone."""
        unfinished = [name for name in self.checkpoint_folders() if name not in committed]
        for name in unfinished:
            self.delete_checkpoint(name)
        return unfinished

    def has_record(self) -> bool:
        """Whether the run record exists (workers check this to see they share the driver's storage)."""
        self.refresh()
        target = self.path_of(RECORD_FILE)
        return self.retry.call("read_record", self.display_path, lambda: self.filesystem.exists(target))

    # -- worker logs ---------------------------------------------------------------------------

    def local_log_dir(self) -> str:
        """Where worker output is written as it comes: the run folder's ``logs/`` on local disk,
        else a local folder copied into it (by the upkeep as the run goes, by :meth:`upload_logs`
        at its end; see :mod:`lockstep._internal.persist.local_logs`)."""
        if is_local(self.filesystem):
            return self.path_of("logs")
        return local_logs.new_local_log_dir(self.display_path)

    def take_in_earlier_logs(self, local_dir: str, last_driver: dict[str, Any] | None) -> None:
        """Before a rerun of the run on remote storage: copy the logs its last driver (the
        record's ``driver``) left on this host when it was killed into the run folder, then fetch
        the run folder's logs into ``local_dir``, where this run appends to them as on local disk."""
        if not is_local(self.filesystem):
            where = {"filesystem": self.filesystem, "remote_logs": self.path_of("logs"), "retry": self.retry}
            local_logs.bring_home_left_logs(**where, shown=self.display_path, last_driver=last_driver)
            local_logs.fetch_earlier_logs(**where, log_dir=local_dir, shown=self.display_path)

    def discard_local_logs(self, local_dir: str) -> None:
        """Remove the local folder of :meth:`local_log_dir` (remote storage) when the run ends
        before its first attempt; nothing to do on local storage."""
        if not is_local(self.filesystem):
            local_logs.remove_local_log_dir(local_dir)

    def upload_logs(self, local_dir: str) -> None:
        """Copy worker logs from a local folder into the run folder's ``logs/`` (remote storage)."""
        if not is_local(self.filesystem):
            upload_with_checksums(
                local_dir, self.filesystem, self.path_of("logs"), self.retry, checksums=False, operation="upload_logs"
            )
            local_logs.remove_local_log_dir(local_dir)

    # -- the record and the report history ----------------------------------------------------

    def write_record(self, record: dict[str, Any]) -> None:
        """Replace ``lockstep_run.json`` atomically: a reader sees the old record or the new one."""
        data = json.dumps(record, indent=1, sort_keys=True)
        target = self.path_of(RECORD_FILE)
        write = self._replace_local_file if is_local(self.filesystem) else self._put_remote_file
        shown = shown_path(self.filesystem, target)
        self.retry.call("write_record", shown, lambda: write(target, data), lambda: len(data.encode()))

    def _replace_local_file(self, target: str, data: str) -> None:
        os.makedirs(self.run_path, exist_ok=True)
        temporary = f"{target}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(data[: len(data) // 2])
                _crash_test_gate(handle)
                handle.write(data[len(data) // 2 :])
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temporary)  # a full disk must not keep a half-written copy
            raise

    def _put_remote_file(self, target: str, data: str) -> None:
        if not is_object_store(self.filesystem):
            self.filesystem.makedirs(self.run_path, exist_ok=True)
        self.filesystem.pipe_file(target, data.encode())

    def read_record(self) -> dict[str, Any] | None:
        """The run record, or None when the folder holds no run yet."""
        self.refresh()
        return self.retry.call("read_record", shown_path(self.filesystem, self.path_of(RECORD_FILE)), self._read_record)

    def _read_record(self) -> dict[str, Any] | None:
        target = self.path_of(RECORD_FILE)
        if not self.filesystem.exists(target):
            return None
        with self.filesystem.open(target, "r", encoding="utf-8") as handle:
            return json.load(handle)

    def open_report_log(self, existing_lines: list[str]) -> ReportLog:
        """The report history of this run, to append to; ``existing_lines`` are already in it."""
        if is_local(self.filesystem):
            return AppendingReportLog(self.path_of(REPORTS_FILE), self.retry)
        return RewritingReportLog(self.filesystem, self.path_of(REPORTS_FILE), existing_lines, self.retry)

    def read_reports(self) -> list[dict[str, Any]]:
        """Every recorded report, oldest first (a torn last line, from a crash, is skipped)."""
        return self.retry.call(
            "read_reports", shown_path(self.filesystem, self.path_of(REPORTS_FILE)), self._read_reports
        )

    def _read_reports(self) -> list[dict[str, Any]]:
        target = self.path_of(REPORTS_FILE)
        if not self.filesystem.exists(target):
            return []
        with self.filesystem.open(target, "r", encoding="utf-8") as handle:
            lines = list(complete_lines(handle))
        reports = []
        for number, line in enumerate(lines, start=1):
            try:
                reports.append(json.loads(line))
            except ValueError:  # a torn append that an older lockstep's rerun wrote after
                logger.warning("%s: line %d is not a report (skipped): %.80r", target, number, line)
        return reports


CRASH_TEST_GATE = "LOCKSTEP_TEST_RECORD_WRITE_GATE"
_record_writes = itertools.count(1)


def _crash_test_gate(handle: Any) -> None:
    """A test-only pause in the middle of a record write (tests/test_crash_safety.py kills the
    driver there). With ``LOCKSTEP_TEST_RECORD_WRITE_GATE="<n>:<fifo>"``, the n-th record write of
    this process flushes its first half to disk, then reads ``<fifo>``, which blocks until the
    test closes its end. Unset (always, outside that test), it does nothing."""
    gate = os.environ.get(CRASH_TEST_GATE)
    if gate is None or next(_record_writes) != int(gate.split(":", 1)[0]):
        return
    handle.flush()
    os.fsync(handle.fileno())
    with open(gate.split(":", 1)[1], encoding="utf-8") as fifo:
        fifo.read()
