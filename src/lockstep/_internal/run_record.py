"""The driver's account of a run: reports and checkpoints as they are committed, the run
record in storage, resuming an earlier run of the same name, and the final Result."""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import asdict
from typing import Any

from lockstep._internal.checkpoints import checkpoints_to_delete
from lockstep._internal.storage import RECORD_FORMAT_VERSION, CheckpointEntry, RunStorage
from lockstep.checkpoint import Checkpoint
from lockstep.config import CheckpointConfig
from lockstep.result import Result, error_to_record, result_from_record

logger = logging.getLogger(__name__)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class RunRecorder:
    """Commits reports and checkpoints to the run folder, in an order that never loses one:
    checkpoint files are moved into place, then the report is logged, then the record that
    names the latest checkpoint is rewritten, and only then are old checkpoints deleted."""

    def __init__(self, storage: RunStorage, checkpoint_config: CheckpointConfig, world_size: int) -> None:
        self.storage = storage
        self.checkpoint_config = checkpoint_config
        self.world_size = world_size
        self.reports: list[dict[str, Any]] = []
        self.checkpoints: list[CheckpointEntry] = []
        self.record: dict[str, Any] = {}
        self._log = storage.open_report_log()
        self._earlier = storage.read_record()
        if self._earlier is not None:
            self._load(self._earlier)

    # -- opening ------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the run folder (or continue the earlier run found there) and mark it running."""
        self.storage.prepare()
        if self._earlier is not None:
            logger.info(
                "Continuing run %s (status %s): %d reports so far, resuming from %s.",
                self.storage.display_path, self._earlier.get("status"), len(self.reports),
                self.checkpoints[-1].dir_name if self.checkpoints else "no checkpoint",
            )
        else:
            self.record = {"format_version": RECORD_FORMAT_VERSION, "name": self.storage.name, "created_at": _now()}
        self.record.update(status="running", world_size=self.world_size, error=None)
        self._write_record()

    def _load(self, earlier: dict[str, Any]) -> None:
        self.record = earlier
        self.reports = self.storage.read_reports()
        self.checkpoints = [CheckpointEntry(**entry) for entry in earlier.get("checkpoints", [])]

    @property
    def next_report_index(self) -> int:
        """The index the next report() will get."""
        return self.reports[-1]["report_index"] + 1 if self.reports else 0

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint."""
        if not self.checkpoints:
            return None
        return Checkpoint(self.storage.checkpoint_path(self.checkpoints[-1].dir_name), self.storage.filesystem)

    # -- committing ---------------------------------------------------------------------------

    def commit_report(self, index: int, metrics_json: str, checkpoint_dir_name: str | None) -> str | None:
        """Record one report (every rank has made it); return the committed checkpoint's path."""
        checkpoint_path = None
        if checkpoint_dir_name is not None:
            checkpoint_path = self.storage.commit_checkpoint(checkpoint_dir_name)
        report = {
            "report_index": index,
            "timestamp": time.time(),
            "metrics": json.loads(metrics_json),
            "checkpoint_dir_name": checkpoint_dir_name,
        }
        self._log.append(json.dumps(report))
        self.reports.append(report)
        if checkpoint_dir_name is not None:
            self._add_checkpoint(CheckpointEntry(checkpoint_dir_name, index, report["metrics"]))
        return checkpoint_path

    def _add_checkpoint(self, entry: CheckpointEntry) -> None:
        self.checkpoints = [known for known in self.checkpoints if known.dir_name != entry.dir_name] + [entry]
        doomed = checkpoints_to_delete(self.checkpoints, self.checkpoint_config)
        self.checkpoints = [known for known in self.checkpoints if known not in doomed]
        self._write_record()
        for old in doomed:
            self.storage.delete_checkpoint(old.dir_name)

    def finish(self, status: str, error: BaseException | None = None) -> None:
        """Mark the run finished, failed or interrupted."""
        self.record.update(status=status, error=error_to_record(error))
        self._write_record()
        self._log.close()

    def _write_record(self) -> None:
        self.record.update(
            updated_at=_now(),
            num_reports=len(self.reports),
            checkpoints=[asdict(entry) for entry in self.checkpoints],
            latest_checkpoint=self.checkpoints[-1].dir_name if self.checkpoints else None,
        )
        self.storage.write_record(self.record)

    def result(self, return_value: Any = None) -> Result:
        """The Result of the run as recorded."""
        return result_from_record(self.storage, self.record, self.reports, return_value)

