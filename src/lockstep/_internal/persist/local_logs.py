"""The workers' logs of a run on remote storage: written into a local folder first, copied into the
run folder's ``logs/`` as the run goes (the driver's upkeep, every few seconds) and whole at its end.

On local disk the logs are written in the run folder itself, and a rerun of the run (the same
name) appends to them. Two steps give remote storage the same behaviour:

* before the run starts, the logs the run folder already holds are fetched into the local folder,
  so the new output follows the earlier runs' instead of replacing their files;
* a driver killed mid-run can't copy its last seconds of output, and its local folder stays. That
  folder (``lockstep_logs_<random>/``) holds ``owner.json`` (the host, the driver's pid and start
  time, the run folder) beside ``logs/``. When the run starts again on this host and its record
  names that driver as the last one (so nothing was added to the run's logs since), the folder's
  logs are copied into the run folder first, and the folder is removed.

A folder left by a driver that is not the run's last one (the run went on from another host since)
is left alone: copying it would put back older files over newer ones.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import socket
import tempfile
from typing import Any

import fsspec

from lockstep._internal.persist.filesystems import download_directory
from lockstep._internal.persist.retry import StorageRetry
from lockstep._internal.persist.run_status import stat_fields
from lockstep._internal.persist.transfer import upload_with_checksums

__all__ = ["LOCAL_LOGS_PREFIX", "OWNER_FILE", "bring_home_left_logs", "fetch_earlier_logs", "new_local_log_dir"]

logger = logging.getLogger(__name__)

LOCAL_LOGS_PREFIX = "lockstep_logs_"
OWNER_FILE = "owner.json"
_LOGS = "logs"


def new_local_log_dir(run_uri: str) -> str:
    """A fresh local folder for the logs of the run at ``run_uri``: ``<temp>/lockstep_logs_*/logs``,
    its parent holding who writes it (:data:`OWNER_FILE`)."""
    folder = tempfile.mkdtemp(prefix=LOCAL_LOGS_PREFIX)
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": started_at(os.getpid()), "run": run_uri}
    with open(os.path.join(folder, OWNER_FILE), "w", encoding="utf-8") as handle:
        json.dump(owner, handle)
    logs = os.path.join(folder, _LOGS)
    os.mkdir(logs)
    return logs


def remove_local_log_dir(log_dir: str) -> None:
    """Remove a folder of :func:`new_local_log_dir` with its owner file."""
    shutil.rmtree(os.path.dirname(log_dir) if _is_owned(log_dir) else log_dir, ignore_errors=True)


def fetch_earlier_logs(
    filesystem: fsspec.AbstractFileSystem, remote_logs: str, log_dir: str, retry: StorageRetry, shown: str
) -> None:
    """Copy the logs the run folder already holds (``remote_logs`` on ``filesystem``; ``shown``:
    the run as messages name it) into ``log_dir``, where this run appends to them."""
    if retry.call("download_logs", shown, lambda: filesystem.isdir(remote_logs)):
        download_directory(filesystem, remote_logs, log_dir, retry, operation="download_logs")


def bring_home_left_logs(
    filesystem: fsspec.AbstractFileSystem,
    remote_logs: str,
    retry: StorageRetry,
    shown: str,
    last_driver: dict[str, Any] | None,
) -> None:
    """Copy into the run folder's logs (``remote_logs``) the logs of the run's last driver
    (``last_driver``: the record's ``{"host", "pid"}``) when it was killed on this host and left its
    local folder, and remove that folder. A copy that fails is logged, and the folder stays for
    the next start. ``shown``: the run folder as messages name it (and as owner files record it)."""
    for folder in _left_folders(shown, last_driver):
        try:
            upload_with_checksums(
                os.path.join(folder, _LOGS), filesystem, remote_logs, retry, checksums=False, operation="upload_logs"
            )
        except OSError as error:
            logger.warning("The logs a killed driver left in %s could not be copied to %s: %s", folder, shown, error)
            continue
        logger.info("Copied the logs a killed driver of this run left in %s to %s.", folder, shown)
        shutil.rmtree(folder, ignore_errors=True)


def _left_folders(run_uri: str, last_driver: dict[str, Any] | None) -> list[str]:
    """The local log folders of ``run_uri`` whose owner is ``last_driver`` and is gone."""
    if not last_driver or last_driver.get("host") != socket.gethostname():
        return []
    found = []
    for owner_file in glob.glob(os.path.join(tempfile.gettempdir(), f"{LOCAL_LOGS_PREFIX}*", OWNER_FILE)):
        owner = _read_owner(owner_file)
        if (
            owner.get("run") == run_uri
            and owner.get("host") == last_driver["host"]
            and owner.get("pid") == last_driver.get("pid")
            and started_at(owner["pid"]) != owner.get("started")  # the process is gone (or the pid reused)
        ):
            found.append(os.path.dirname(owner_file))
    return found


def _read_owner(owner_file: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError), open(owner_file, encoding="utf-8") as handle:
        owner = json.load(handle)
        if isinstance(owner, dict) and isinstance(owner.get("pid"), int):
            return owner
    return {}


def _is_owned(log_dir: str) -> bool:
    return os.path.basename(log_dir) == _LOGS and os.path.isfile(os.path.join(os.path.dirname(log_dir), OWNER_FILE))


def started_at(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot; with its pid, names one process
    for good), or None when there is no such process or it has exited (a zombie)."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])
