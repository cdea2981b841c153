"""Everything that touches storage: paths and URIs to filesystems, the run folder's layout,
and the atomic steps (stage, commit, record) that make checkpoints safe.

Run folder layout (``<storage_path>/<name>/``)::

    lockstep_run.json        the run record: status, reports so far, committed checkpoints, error
    reports.jsonl            one JSON line per report(): report_index, timestamp, metrics, checkpoint
    checkpoint_000003/       committed checkpoints (every rank's files merged into one folder)
    .staging/checkpoint_…/   checkpoints being written; never read as results

A checkpoint becomes part of the run only when the driver has moved it out of ``.staging`` and
rewritten ``lockstep_run.json`` (written to a temporary name, then renamed over the old one).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

RECORD_FILE = "lockstep_run.json"
REPORTS_FILE = "reports.jsonl"
STAGING_DIR = ".staging"
RECORD_FORMAT_VERSION = 1


def resolve_filesystem(path: str | os.PathLike[str], filesystem: Any = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Turn a local path or URI (``s3://…``) into ``(filesystem, path on that filesystem)``."""
    path = os.fspath(path)
    if filesystem is not None:
        return filesystem, path
    if "://" not in path:
        return LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    return fsspec.core.url_to_fs(path)


def is_local(filesystem: fsspec.AbstractFileSystem) -> bool:
    """Whether ``filesystem`` is this machine's own disk."""
    return isinstance(filesystem, LocalFileSystem)


def copy_local_tree(source: str, destination: str) -> None:
    """Copy a local folder's files into ``destination``, merging with what is already there."""
    shutil.copytree(source, destination, dirs_exist_ok=True)


def upload_directory(local_dir: str, filesystem: fsspec.AbstractFileSystem, destination: str) -> None:
    """Copy a local folder to ``destination`` on ``filesystem`` (merging into it)."""
    if is_local(filesystem):
        copy_local_tree(local_dir, destination)
        return
    filesystem.makedirs(destination, exist_ok=True)
    filesystem.put(local_dir.rstrip("/") + "/", destination, recursive=True)


def download_directory(filesystem: fsspec.AbstractFileSystem, source: str, local_dir: str) -> None:
    """Copy the folder ``source`` on ``filesystem`` into the local folder ``local_dir``."""
    if is_local(filesystem):
        copy_local_tree(source, local_dir)
        return
    os.makedirs(local_dir, exist_ok=True)
    filesystem.get(source.rstrip("/") + "/", local_dir, recursive=True)


def join(*parts: str) -> str:
    """Join path parts with '/', the separator every fsspec filesystem understands."""
    return "/".join([parts[0].rstrip("/"), *(part.strip("/") for part in parts[1:])])


@dataclass(frozen=True)
class CheckpointEntry:
    """One committed checkpoint as the run record lists it."""

    dir_name: str
    report_index: int
    metrics: dict[str, Any]


class RunStorage:
    """The run folder ``<storage_path>/<name>`` and the operations on it.

    Picklable: the driver creates it, and workers get a copy to stage their checkpoint files.
    """

    def __init__(self, run_path: str | os.PathLike[str], filesystem: Any = None) -> None:
        self.filesystem, self.run_path = resolve_filesystem(run_path, filesystem)
        self.name = self.run_path.rstrip("/").rsplit("/", 1)[-1]

    @classmethod
    def for_run(cls, storage_path: str, name: str, filesystem: Any = None) -> "RunStorage":
        """The run folder ``name`` under ``storage_path``."""
        fs, base = resolve_filesystem(storage_path, filesystem)
        return cls(join(base, name), fs)

    @property
    def display_path(self) -> str:
        """The run folder as the user would write it (a URI for remote storage)."""
        if is_local(self.filesystem):
            return self.run_path
        return self.filesystem.unstrip_protocol(self.run_path)

    def path_of(self, *parts: str) -> str:
        """A path inside the run folder."""
        return join(self.run_path, *parts)

    # -- set-up -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the run folder, and clear checkpoints left half-written by an earlier attempt."""
        self.filesystem.makedirs(self.run_path, exist_ok=True)
        staging = self.path_of(STAGING_DIR)
        if self.filesystem.exists(staging):
            self.filesystem.rm(staging, recursive=True)

    # -- checkpoints --------------------------------------------------------------------------

    def staging_path(self, dir_name: str) -> str:
        """Where ranks write the files of a checkpoint that isn't committed yet."""
        return self.path_of(STAGING_DIR, dir_name)

    def checkpoint_path(self, dir_name: str) -> str:
        """Where a committed checkpoint lives."""
        return self.path_of(dir_name)

    def stage_checkpoint(self, local_dir: str, dir_name: str) -> None:
        """Copy one rank's checkpoint files into the staging folder of ``dir_name``."""
        upload_directory(local_dir, self.filesystem, self.staging_path(dir_name))

    def commit_checkpoint(self, dir_name: str) -> str:
        """Move a fully staged checkpoint to its final place and return that path."""
        final = self.checkpoint_path(dir_name)
        if self.filesystem.exists(final):
            self.filesystem.rm(final, recursive=True)
        self.filesystem.mv(self.staging_path(dir_name), final, recursive=True)
        return final

    def delete_checkpoint(self, dir_name: str) -> None:
        """Remove a committed checkpoint (after the record no longer lists it)."""
        path = self.checkpoint_path(dir_name)
        if self.filesystem.exists(path):
            self.filesystem.rm(path, recursive=True)

    # -- the record and the report history ----------------------------------------------------

    def write_record(self, record: dict[str, Any]) -> None:
        """Replace ``lockstep_run.json`` atomically: a reader sees the old record or the new one."""
        data = json.dumps(record, indent=1, sort_keys=True)
        target = self.path_of(RECORD_FILE)
        if is_local(self.filesystem):
            temporary = f"{target}.{uuid.uuid4().hex}.tmp"
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(data)
            os.replace(temporary, target)
        else:
            self.filesystem.pipe_file(target, data.encode())

    def read_record(self) -> dict[str, Any] | None:
        """The run record, or None when the folder holds no run yet."""
        target = self.path_of(RECORD_FILE)
        if not self.filesystem.exists(target):
            return None
        with self.filesystem.open(target, "r", encoding="utf-8") as handle:
            return json.load(handle)

    def open_report_log(self) -> "ReportLog":
        """The append-only report history of this run."""
        return ReportLog(self.filesystem, self.path_of(REPORTS_FILE))

    def read_reports(self) -> list[dict[str, Any]]:
        """Every recorded report, oldest first."""
        return list(ReportLog(self.filesystem, self.path_of(REPORTS_FILE)).read())


class ReportLog:
    """``reports.jsonl``: one line per report, appended as reports are committed."""

    def __init__(self, filesystem: fsspec.AbstractFileSystem, path: str) -> None:
        self.filesystem = filesystem
        self.path = path
        self._handle: Any = None

    def append(self, line: str) -> None:
        """Add one JSON line and flush it to the file."""
        if self._handle is None:
            self._handle = self.filesystem.open(self.path, "a", encoding="utf-8")
        self._handle.write(line + "\n")
        self._handle.flush()

    def read(self) -> Iterator[dict[str, Any]]:
        """Yield each complete line as a dict (a torn last line, from a crash, is skipped)."""
        if not self.filesystem.exists(self.path):
            return
        with self.filesystem.open(self.path, "r", encoding="utf-8") as handle:
            for line in handle:
                if line.endswith("\n"):
                    yield json.loads(line)

    def close(self) -> None:
        """Close the file."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def make_temp_dir(prefix: str) -> str:
    """A fresh local temporary folder."""
    return tempfile.mkdtemp(prefix=prefix)
