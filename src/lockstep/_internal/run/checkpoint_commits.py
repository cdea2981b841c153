"""Checkpoint commits of one worker group: a reported checkpoint is committed once every rank's
files are in storage. With ASYNC uploads that can be after the report itself; commits still
happen in report order, so the run's latest checkpoint never goes back in time.

The folders the group began to write are remembered, so those of a failed attempt that were
never committed can be deleted before a restart.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.run.failures import FailureKind
from lockstep._internal.wire.protocol import CheckpointUploaded, Report
from lockstep.errors import TrainingFailedError, WorkerFailure


@dataclass
class PendingCheckpoint:
    """A reported checkpoint whose ASYNC uploads are still running on ``waiting`` ranks, and
    the validation its report asked for (see :class:`~lockstep._internal.wire.protocol.Report`);
    ``files``: each rank's files so far, for the checkpoint's manifest."""

    dir_name: str
    metrics: dict[str, Any]
    waiting: set[int]
    external_path: str | None = None
    validation: bool | dict[str, Any] | None = None
    files: dict[int, list[Any]] = field(default_factory=dict)
    places: dict[int, str | None] = field(default_factory=dict)  # where each rank put it (None: the run folder)


class CheckpointCommits:
    """Reported checkpoints of one worker group until they can be committed."""

    def __init__(self) -> None:
        self.pending: dict[int, PendingCheckpoint] = {}
        self.uploaded_early: set[tuple[int, int]] = set()
        self.early_external_paths: dict[int, str] = {}
        self.early_places: dict[int, dict[int, str | None]] = {}
        self.early_files: dict[int, dict[int, list[Any]]] = {}
        self.written_dir_names: set[str] = set()

    def writing(self, dir_name: str) -> None:
        """A rank began writing the checkpoint folder ``dir_name``."""
        self.written_dir_names.add(dir_name)

    def reported(self, index: int, dir_name: str, metrics: dict[str, Any], calls: Iterable[Report]) -> None:
        """Report ``index`` (every rank's ``calls``) named checkpoint ``dir_name``."""
        with_checkpoint = [call for call in calls if call.checkpoint_dir_name is not None]
        uploading = {
            call.rank
            for call in with_checkpoint
            if call.checkpoint_state == "uploading" and (index, call.rank) not in self.uploaded_early
        }
        external = next((call.external_path for call in with_checkpoint if call.external_path), None)
        external = external or self.early_external_paths.pop(index, None)
        # as in Ray Train: the validation asked for by the lowest rank that passed a checkpoint
        validation = min(with_checkpoint, key=lambda call: call.rank).validation
        files = {call.rank: call.files for call in with_checkpoint if call.files is not None}
        files.update(self.early_files.pop(index, {}))
        places = {call.rank: call.external_path for call in with_checkpoint if call.checkpoint_state != "uploading"}
        places.update(self.early_places.pop(index, {}))
        self.pending[index] = PendingCheckpoint(
            dir_name, metrics, uploading, external_path=external, validation=validation, files=files, places=places
        )

    def uploaded(self, event: CheckpointUploaded) -> WorkerFailure | None:
        """A rank's ASYNC upload ended; a failed one is returned as the rank's failure."""
        if event.error is not None:
            return FailureKind.CHECKPOINT_UPLOAD_ERROR.failure(event.rank, event.error)
        pending = self.pending.get(event.index)
        if pending is None:  # the upload beat the other ranks' report() calls
            self.uploaded_early.add((event.index, event.rank))
            self.early_places.setdefault(event.index, {})[event.rank] = event.external_path
            if event.external_path:
                self.early_external_paths.setdefault(event.index, event.external_path)
            if event.files is not None:
                self.early_files.setdefault(event.index, {})[event.rank] = event.files
        else:
            pending.waiting.discard(event.rank)
            pending.places[event.rank] = event.external_path
            pending.external_path = pending.external_path or event.external_path
            if event.files is not None:
                pending.files[event.rank] = event.files
        return None

    def first_pending(self) -> int | None:
        """The index of the oldest checkpoint not committed yet (``None``: all are)."""
        return min(self.pending, default=None)

    def ready(self) -> Iterator[tuple[int, PendingCheckpoint]]:
        """The checkpoints that can be committed now, in report order: each is forgotten once
        the caller has committed it and asks for the next."""
        for index in sorted(self.pending):
            pending = self.pending[index]
            if pending.waiting:
                return
            _check_one_place(index, pending)
            yield index, pending
            del self.pending[index]


def _check_one_place(index: int, pending: PendingCheckpoint) -> None:
    """Refuse a checkpoint whose ranks put their files in different places (each rank's
    checkpoint_upload_fn returned another path, or one rank's is the run folder): the record can
    name only one, and the other ranks' files would be lost from it (Ray Train refuses it too).

    Raises:
        TrainingFailedError: the ranks' places differ.
    """
    if len(set(pending.places.values())) > 1:
        shown = "; ".join(f"rank {rank}: {place or 'the run folder'}" for rank, place in sorted(pending.places.items()))
        raise TrainingFailedError(
            f"report #{index}: the ranks put checkpoint {pending.dir_name} in different places ({shown}); "
            "every rank's checkpoint_upload_fn must return the same checkpoint (one folder all ranks write into)."
        )


def agreed_dir_name(index: int, calls: Iterable[Report]) -> str | None:
    """The checkpoint folder the ranks of report ``index`` named (``None``: no checkpoint).

    Raises:
        TrainingFailedError: ranks named different folders.
    """
    dir_names = sorted({call.checkpoint_dir_name for call in calls if call.checkpoint_dir_name is not None})
    if len(dir_names) > 1:
        raise TrainingFailedError(
            f"report #{index}: ranks passed different checkpoint_dir_name values {dir_names}; "
            "every rank must use the same name."
        )
    return dir_names[0] if dir_names else None
