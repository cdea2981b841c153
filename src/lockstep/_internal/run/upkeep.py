"""The driver's upkeep while a run goes on, on a thread of its own: the run record's heartbeat
(see :meth:`RunRecorder.beat`) and, on remote storage, the workers' logs copied into the run
folder every few seconds, so that a dashboard on another machine can show their tails live.

On local storage the logs are written in the run folder already; on object stores each changed
log file is uploaded whole, at most every :data:`LOG_SYNC_INTERVAL_S` (object stores can't
append), up to :data:`LIVE_LOG_LIMIT_BYTES`; past that size a log reaches storage when the run
ends, as every log does then (:meth:`RunStorage.upload_logs`).
"""

from __future__ import annotations

import logging
import os
import threading
from types import TracebackType

from lockstep._internal.persist.fault_kinds import FaultKind, classify
from lockstep._internal.persist.filesystems import is_local, join
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.run.run_record import RunRecorder

logger = logging.getLogger(__name__)

#: How often the upkeep thread wakes: logs are uploaded at most this often.
LOG_SYNC_INTERVAL_S = 5.0
#: Log files larger than this are not uploaded while the run goes on.
LIVE_LOG_LIMIT_BYTES = 64 * 1024 * 1024


class LogSync:
    """Uploads the files of a local log folder that changed since the last call into the run
    folder's ``logs/`` (for remote storage; on local storage it does nothing)."""

    def __init__(self, storage: RunStorage, local_dir: str) -> None:
        self.storage = storage
        self.local_dir = local_dir
        self.active = not is_local(storage.filesystem)
        self._uploaded: dict[str, tuple[int, int]] = {}

    def sync(self) -> None:
        """Upload each changed file (a failure is logged once per file and tried again next time)."""
        if not self.active or not os.path.isdir(self.local_dir):
            return
        for folder, _, names in os.walk(self.local_dir):
            for name in names:
                self._sync_file(os.path.join(folder, name))

    def _sync_file(self, path: str) -> None:
        try:
            stat = os.stat(path)
        except OSError:
            return
        version = (stat.st_size, stat.st_mtime_ns)
        if self._uploaded.get(path) == version or stat.st_size > LIVE_LOG_LIMIT_BYTES:
            return
        relative = os.path.relpath(path, self.local_dir).replace(os.sep, "/")
        try:
            self.storage.filesystem.put_file(path, join(self.storage.path_of("logs"), relative))
        except Exception as error:  # noqa: BLE001 - a log copy must never stop the run
            if path not in self._uploaded and classify(error) is not FaultKind.TRANSIENT:  # an outage is logged once
                logger.warning("could not copy the log %s to %s: %s", relative, self.storage.display_path, error)
            self._uploaded[path] = (-1, -1)
            return
        self._uploaded[path] = version


class RunUpkeep:
    """A thread that, while the run goes on, beats its record and syncs its logs; use it as a
    context manager around the controller's run.

    Args:
        recorder: The run's record.
        log_dir: The local folder the workers' logs are written to.
        interval_s: How often the thread wakes.
    """

    def __init__(self, recorder: RunRecorder, log_dir: str, interval_s: float = LOG_SYNC_INTERVAL_S) -> None:
        self.recorder = recorder
        self.logs = LogSync(recorder.storage, log_dir)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lockstep-run-upkeep", daemon=True)
        self._beat_failed = False

    def __enter__(self) -> RunUpkeep:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()
            self.logs.sync()

    def _beat(self) -> None:
        try:
            self.recorder.beat()
        except Exception as error:  # noqa: BLE001 - the next commit or beat tries again
            if not self._beat_failed:
                logger.warning("could not rewrite the run record's heartbeat: %s", error)
            self._beat_failed = True
        else:
            self._beat_failed = False
