"""``lockstep verify RUN``: every kept checkpoint of a run checked against its manifest."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lockstep._internal.persist.manifest import verify_folder
from lockstep._internal.persist.storage import CheckpointEntry, RunStorage
from lockstep.errors import CheckpointCorruptedError

WHOLE, DAMAGED, MISSING, UNVERIFIED, RETIRED = "whole", "DAMAGED", "MISSING", "unverified", "retired"


@dataclass(frozen=True)
class CheckpointCheck:
    """How one checkpoint fared: ``state`` is whole, DAMAGED, MISSING (no folder), unverified
    (no manifest: an older lockstep, or NO_UPLOAD) or retired (a running run's retention deleted
    it while it was checked); ``problems`` name the files."""

    dir_name: str
    uri: str
    state: str
    problems: tuple[str, ...] = ()

    @property
    def bad(self) -> bool:
        """Whether loading this checkpoint would fail or load wrong files."""
        return self.state in (DAMAGED, MISSING)

    def line(self) -> str:
        """One line for the terminal."""
        detail = {
            WHOLE: "every file matches its manifest",
            MISSING: "the folder is gone",
            UNVERIFIED: "no manifest (written by an older lockstep, or NO_UPLOAD): not checked",
            RETIRED: "deleted by the running run's num_to_keep while it was checked: no longer kept",
        }.get(self.state, "; ".join(self.problems))
        return f"{self.dir_name}  {self.state}  {detail}  ({self.uri})"


def check_checkpoint(storage: RunStorage, entry: CheckpointEntry) -> CheckpointCheck:
    """Check one checkpoint the run record lists."""
    checkpoint = storage.checkpoint_of(entry)
    filesystem, path = checkpoint.filesystem, checkpoint.path
    filesystem.invalidate_cache(path)
    if not filesystem.isdir(path):
        return CheckpointCheck(entry.dir_name, checkpoint.uri, MISSING)
    try:
        problems = verify_folder(filesystem, path)
    except CheckpointCorruptedError as error:
        problems = error.problems
    except FileNotFoundError:  # deleted while it was read
        return CheckpointCheck(entry.dir_name, checkpoint.uri, MISSING)
    if problems is None:
        return CheckpointCheck(entry.dir_name, checkpoint.uri, UNVERIFIED)
    return CheckpointCheck(entry.dir_name, checkpoint.uri, DAMAGED if problems else WHOLE, tuple(problems))


def check_run(storage: RunStorage, record: dict[str, Any]) -> list[CheckpointCheck]:
    """Check every checkpoint the run record keeps, oldest first. A running run may delete some
    meanwhile (``num_to_keep``): a missing or damaged one that its record no longer lists is retired."""
    checks = [check_checkpoint(storage, CheckpointEntry(**entry)) for entry in record.get("checkpoints", [])]
    if record.get("status") == "running" and any(check.bad for check in checks):
        kept = {entry["dir_name"] for entry in (storage.read_record() or {}).get("checkpoints", [])}
        checks = [_retired(check) if check.bad and check.dir_name not in kept else check for check in checks]
    return checks


def _retired(check: CheckpointCheck) -> CheckpointCheck:
    return replace(check, state=RETIRED, problems=())
