"""The driver's account of a run: reports and checkpoints as they are committed, the run
record in storage, resuming an earlier run of the same name, and the final Result."""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, replace
from typing import Any

from lockstep._internal.persist.filesystems import shown_path
from lockstep._internal.persist.manifest import write_manifest
from lockstep._internal.persist.outages import RECORD_KEY as OUTAGES_KEY
from lockstep._internal.persist.outages import add_outage
from lockstep._internal.persist.results import error_to_record, result_fields
from lockstep._internal.persist.retry import Outage
from lockstep._internal.persist.storage import RECORD_FILE, RECORD_FORMAT_VERSION, CheckpointEntry, RunStorage
from lockstep._internal.run.checkpoints import (
    PENDING_VALIDATION,
    awaiting_validation,
    best_checkpoints,
    checkpoints_to_delete,
    unscored,
)
from lockstep._internal.run.stragglers import RECENT_REPORTS, SlowRankWatch, keeps_step_times
from lockstep.checkpoint import Checkpoint
from lockstep.config import CheckpointConfig
from lockstep.result import Result

logger = logging.getLogger(__name__)

#: The record is rewritten at least this often while the run goes on (its ``heartbeat_at``), so
#: that a reader on any host can tell a running run from one whose driver is gone.
HEARTBEAT_INTERVAL_S = 30.0

#: The status of a checkpoint whose validation returned its metrics (``ReportedCheckpointStatus``'s value).
VALIDATED = "VALIDATED"


def _entry_record(entry: CheckpointEntry) -> dict[str, Any]:
    """A checkpoint as the record lists it; the validation fields only once a validation was
    asked for (so that the record of a run without validations reads as before)."""
    fields = asdict(entry)
    for name in ("validation", "validation_request"):
        if fields[name] is None:
            del fields[name]
    return fields


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="milliseconds"
    )  # orders runs started within a second


class RunRecorder:
    """Commits reports and checkpoints to the run folder, in an order that never loses one:
    every rank has written its checkpoint files, then the report is logged, then the record
    that names the new checkpoint replaces the old one, and only then are checkpoints beyond
    ``num_to_keep`` deleted.

    Creating a recorder only reads storage; :meth:`open` is the first write. Every write stamps
    ``heartbeat_at``; :meth:`beat`, called from the driver's upkeep thread, rewrites the record
    when nothing else did for :data:`HEARTBEAT_INTERVAL_S` (writes are serialized by a lock, so a
    beat never puts back an older record).

    A checkpoint reported with ``validation=...`` is committed as pending validation, with what
    was asked, in that same record write; only then does its validation start. When it ends,
    the record is rewritten with the status (and, once validated, the merged metrics) before
    any checkpoint it outranks is deleted. A driver that dies in between leaves the checkpoint
    pending in the record, and the next run of the same name validates it again.

    Creating a recorder only reads storage; :meth:`open` is the first write.
    """

    def __init__(
        self, storage: RunStorage, checkpoint_config: CheckpointConfig, world_size: int, executor: str = "local"
    ) -> None:
        self.storage = storage
        self.checkpoint_config = checkpoint_config
        self.world_size = world_size
        self.executor = executor
        storage.retry.on_outage_end = self.note_outage
        self._earlier = storage.read_record()
        self.record: dict[str, Any] = dict(self._earlier or {})
        self.reports: list[dict[str, Any]] = storage.read_reports() if self._earlier else []
        self.checkpoints = [CheckpointEntry(**entry) for entry in self.record.get("checkpoints", [])]
        self._log = storage.open_report_log([json.dumps(report) for report in self.reports])
        self._write_lock = threading.Lock()
        self._last_write = 0.0
        self._warned_unscored = False
        # per-rank step times stay in reports.jsonl; in memory only the slow-rank rule's reading of them
        self.slow_ranks = SlowRankWatch()
        timed = [report.pop("step_times") for report in self.reports if report.get("step_times")]
        for step_times in timed[-RECENT_REPORTS:]:
            self.slow_ranks.add(step_times)

    @property
    def earlier_record(self) -> dict[str, Any] | None:
        """The record of the earlier run of this name found in storage (None: a new run)."""
        return self._earlier

    def check_resumable(self) -> None:
        """Refuse to continue a run whose record names a checkpoint that is gone, and to start
        one in a folder of checkpoints that no record names (not a lockstep run, or its record
        was deleted: starting would delete them as unfinished writes, or mix files into them).

        Raises:
            ValueError: the latest checkpoint's folder is missing, or checkpoint folders lie in
                a run folder without a record.
        """
        if self._earlier is None:
            strays = self.storage.checkpoint_folders()
            if strays:
                raise ValueError(
                    f"{self.storage.display_path} holds checkpoint folders ({', '.join(strays[:3])}"
                    f"{', ...' if len(strays) > 3 else ''}) but no run record ({RECORD_FILE}): it is not a lockstep "
                    "run, or its record was deleted. Choose another RunConfig.name (or storage_path), or move those "
                    "folders away; a new run can start from one of them with "
                    "TorchTrainer(resume_from_checkpoint=Checkpoint(path))."
                )
        latest = self.latest_checkpoint
        if latest is None:
            return
        if not self.storage.retry.call("read_record", latest.uri, lambda: latest.filesystem.exists(latest.path)):
            raise ValueError(
                f"The run {self.storage.display_path} lists {self.checkpoints[-1].dir_name} as its latest "
                f"checkpoint, but {latest.path} is missing. Restore that folder, or start a new run (another "
                "RunConfig.name, or delete the run folder)."
            )

    def open(self, run_fields: dict[str, Any] | None = None) -> None:
        """Create the run folder (or continue the earlier run found there) and mark it running,
        with ``run_fields`` (e.g. ``config``, ``metrics_url``) added to the record."""
        if self._earlier is not None:
            resumed_from = self.checkpoints[-1].dir_name if self.checkpoints else "no checkpoint"
            logger.info(
                "Continuing run %s (it was %s): %d reports so far, resuming from %s.",
                self.storage.display_path,
                self._earlier.get("status"),
                len(self.reports),
                resumed_from,
            )
        else:
            self.record = {"format_version": RECORD_FORMAT_VERSION, "name": self.storage.name, "created_at": _now()}
        self.record.update(
            status="running",
            world_size=self.world_size,
            executor=self.executor,
            error=None,
            driver={"host": socket.gethostname(), "pid": os.getpid()},
            ranks={},
            **(run_fields or {}),
        )
        self._write_record()
        removed = self.storage.delete_unfinished_checkpoints({entry.dir_name for entry in self.checkpoints})
        if removed:
            logger.info("Removed unfinished checkpoint folders of an earlier attempt: %s", ", ".join(removed))

    def note_rank(self, rank: int, host: str, pid: int) -> None:
        """Where ``rank`` of the current worker group runs (written with the next record write)."""
        self.record["ranks"] = {**self.record.get("ranks", {}), str(rank): {"host": host, "pid": pid}}

    def beat(self) -> None:
        """Rewrite the record of a running run that was not written for :data:`HEARTBEAT_INTERVAL_S`."""
        with self._write_lock:
            if self.record.get("status") != "running" or time.monotonic() - self._last_write < HEARTBEAT_INTERVAL_S:
                return
            self._stamp_and_write()

    def note_outage(self, outage: Outage, seen_by: str = "driver") -> None:
        """A storage outage the driver (or a rank, ``seen_by="rank <r>"``) rode out: it goes into
        the record's ``storage_outages`` (written with the next record write)."""
        self.record[OUTAGES_KEY] = add_outage(self.record.get(OUTAGES_KEY), outage, seen_by)

    def set_world_size(self, world_size: int) -> None:
        """The number of workers of the coming attempt (it can change in an elastic run)."""
        self.world_size = world_size
        self.record["world_size"] = world_size

    def discard_uncommitted(self, dir_names: set[str]) -> None:
        """Delete the folders of checkpoints a failed attempt began but never committed, so a
        restart doesn't mix its files with theirs."""
        for name in sorted(dir_names - set(self.committed_dir_names)):
            self.storage.delete_checkpoint(name)

    @property
    def next_report_index(self) -> int:
        """The index the next report() will get."""
        return self.reports[-1]["report_index"] + 1 if self.reports else 0

    @property
    def committed_dir_names(self) -> list[str]:
        """The folder names of the kept checkpoints, oldest first."""
        return [entry.dir_name for entry in self.checkpoints]

    def latest_entry(self) -> CheckpointEntry | None:
        """The record entry of the newest committed checkpoint."""
        return self.checkpoints[-1] if self.checkpoints else None

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint."""
        return self.storage.checkpoint_of(self.checkpoints[-1]) if self.checkpoints else None

    # -- committing ---------------------------------------------------------------------------

    def log_report(
        self,
        index: int,
        metrics_json: str,
        checkpoint_dir_name: str | None,
        step_times: dict[str, dict[str, float]] | None = None,
    ) -> dict[str, Any]:
        """Add one report (every rank has made it) to the history, with each rank's
        ``step_times`` when they sent them (see :mod:`lockstep._internal.run.stragglers`; with
        many ranks the history keeps them for every few reports only, :func:`keeps_step_times`)."""
        report: dict[str, Any] = {
            "report_index": index,
            "timestamp": time.time(),
            "metrics": json.loads(metrics_json),
            "checkpoint_dir_name": checkpoint_dir_name,
        }
        kept = step_times is not None and keeps_step_times(index, len(step_times))
        self._log.append(json.dumps({**report, "step_times": step_times} if kept else report))
        if step_times is not None:
            self.slow_ranks.add(step_times)
        self.reports.append(report)
        return report

    def commit_checkpoint(
        self,
        dir_name: str,
        report_index: int,
        metrics: dict[str, Any],
        external_path: str | None = None,
        validation: bool | dict[str, Any] | None = None,
        files: dict[int, list[Any]] | None = None,
    ) -> CheckpointEntry:
        """Make a fully written checkpoint the run's latest; with a ``validation`` request, it
        is recorded as pending validation (with the request, so a later run can start it).
        ``files`` (each rank's, as the ranks copied them) go into its manifest first."""
        if files and external_path is None:
            folder = self.storage.checkpoint_path(dir_name)
            write = functools.partial(write_manifest, self.storage.filesystem, folder, files)
            self.storage.retry.call("write_manifest", shown_path(self.storage.filesystem, folder), write)
        self._log.flush()
        entry = CheckpointEntry(dir_name, report_index, metrics, external_path)
        if validation is not None:
            entry = replace(entry, validation=PENDING_VALIDATION, validation_request=validation)
        self.checkpoints = [known for known in self.checkpoints if known.dir_name != dir_name] + [entry]
        if validation is None and unscored(entry, self.checkpoint_config) and not self._warned_unscored:
            self._warned_unscored = True
            logger.warning(
                "checkpoint_score_attribute=%r is not a number among the metrics of %s (%s): it ranks last, and "
                "num_to_keep deletes it first. Report that metric with every checkpoint.",
                self.checkpoint_config.checkpoint_score_attribute,
                dir_name,
                ", ".join(sorted(metrics)) or "none",
            )
        self._write_and_retain()
        logger.debug("committed %s", dir_name)
        return entry

    def finish_validation(self, dir_name: str, status: str, metrics: dict[str, Any]) -> CheckpointEntry | None:
        """Record how the validation of checkpoint ``dir_name`` ended: ``status`` (VALIDATED,
        VALIDATION_FAILED or VALIDATION_TIMEOUT) and, once VALIDATED, its ``metrics`` merged
        into the checkpoint's (they win). Then checkpoints beyond ``num_to_keep`` go, now that
        its score is known. Returns the updated entry (None if the record has no such checkpoint)."""
        for position, entry in enumerate(self.checkpoints):
            if entry.dir_name == dir_name:
                merged = {**entry.metrics, **metrics} if status == VALIDATED else entry.metrics
                updated = replace(entry, metrics=merged, validation=status, validation_request=None)
                self.checkpoints[position] = updated
                self._write_and_retain()
                return updated
        logger.warning("The validation of %s ended (%s), but the run no longer lists it.", dir_name, status)
        return None

    def pending_validations(self) -> list[CheckpointEntry]:
        """The kept checkpoints whose validation has not ended, oldest first."""
        return [entry for entry in self.checkpoints if awaiting_validation(entry)]

    def _write_and_retain(self) -> None:
        """Write the record without the checkpoints beyond ``num_to_keep``, then delete their
        folders (the record never names a deleted folder)."""
        doomed = checkpoints_to_delete(self.checkpoints, self.checkpoint_config)
        self.checkpoints = [known for known in self.checkpoints if known not in doomed]
        self._write_record()
        for old in doomed:
            if old.path is None:
                self.storage.delete_checkpoint(old.dir_name)

    def count_failure(self) -> None:
        """One more failed attempt (kept in the record across resumed runs)."""
        self.record["num_failures"] = int(self.record.get("num_failures", 0)) + 1
        self._write_record()

    def finish(self, status: str, error: BaseException | None = None, reason: str | None = None) -> None:
        """Mark the run finished, stopped, pruned, failed, interrupted or preempted (a
        preemption is counted in ``num_preemptions``, never as a failure); ``reason`` says why a
        run stopped (``stop_reason``). When storage itself is what failed, this is logged rather
        than raised, so the run's own error stays the one the user sees."""
        self.record.update(status=status, error=error_to_record(error), stop_reason=reason)
        if status == "preempted":
            self.record["num_preemptions"] = int(self.record.get("num_preemptions", 0)) + 1
        try:
            self._log.close()
            self._write_record()
        except Exception as write_error:  # noqa: BLE001
            if error is None:
                raise
            logger.warning("could not mark the run %s in %s: %s", status, self.storage.display_path, write_error)

    def _write_record(self) -> None:
        self.record.update(
            updated_at=_now(),
            num_reports=len(self.reports),
            checkpoints=[_entry_record(entry) for entry in self.checkpoints],
            latest_checkpoint=self.checkpoints[-1].dir_name if self.checkpoints else None,
            best_checkpoints=[entry.dir_name for entry in best_checkpoints(self.checkpoints, self.checkpoint_config)],
        )
        with self._write_lock:
            self._stamp_and_write()

    def _stamp_and_write(self) -> None:
        """Write the record with this moment as its heartbeat (the caller holds the write lock)."""
        self.record.update(heartbeat_at=time.time(), heartbeat_interval_s=HEARTBEAT_INTERVAL_S)
        # a copy: a beat's write iterates it while the controller's thread may add a key to the record
        self.storage.write_record(dict(self.record))
        self._last_write = time.monotonic()

    def result(self, return_value: Any = None) -> Result:
        """The Result of the run as recorded."""
        return Result(**result_fields(self.storage, self.record, self.reports, return_value))
