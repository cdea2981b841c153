"""How a rank's reported checkpoint reaches storage: copied into its folder in the run, or handed
to the user's ``checkpoint_upload_fn``; at once (SYNC) or on a background thread (ASYNC); and,
with ``delete_local_checkpoint_after_upload``, the local folder removed afterwards. An upload
counts as the rank's progress for as long as it takes (``PROGRESS.making_progress()``), so the
hang detector never names a rank that is uploading.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockstep._internal.persist.filesystems import is_local
from lockstep._internal.persist.manifest import FileSum
from lockstep._internal.persist.storage import CheckpointEntry, RunStorage
from lockstep._internal.rank.progress import PROGRESS
from lockstep._internal.rank.upload_staging import private_copy
from lockstep._internal.wire import protocol
from lockstep._internal.wire.channel import WorkerChannel
from lockstep.checkpoint import Checkpoint
from lockstep.errors import StorageFullError, StorageUnreachableError

if TYPE_CHECKING:
    from lockstep._internal.rank.train_context import TrainContext

logger = logging.getLogger(__name__)

UploadFn = Callable[[Checkpoint, str], Checkpoint]


@dataclass(frozen=True)
class Upload:
    """One report's checkpoint upload: the folder name it gets, the user's upload function (if
    any) and whether the local folder goes once the upload succeeded."""

    dir_name: str
    upload_fn: UploadFn | None = None
    delete_local: bool = False


def upload(
    context: TrainContext, checkpoint: Checkpoint, job: Upload, given_goes: bool = False
) -> tuple[str | None, list[FileSum] | None]:
    """Put this rank's files of ``checkpoint`` in storage; return where the checkpoint is when
    ``job.upload_fn`` put it somewhere other than its folder in the run (else ``None``), and
    the path, size and checksum of each file lockstep copied (``None`` when ``job.upload_fn`` did).
    ``given_goes``: ``checkpoint``'s folder is deleted after the upload (ASYNC's staged copy).

    Raises:
        OSError: copying the files failed.
        TypeError: ``checkpoint_upload_fn`` returned something that is not a Checkpoint.
        ValueError: it returned the very checkpoint it was given, which is deleted next.
    """
    if job.upload_fn is None:
        with checkpoint.as_directory() as local_dir:
            return None, write_checkpoint(context, local_dir, job.dir_name)
    uploaded = job.upload_fn(checkpoint, job.dir_name)
    if not isinstance(uploaded, Checkpoint):
        raise TypeError(
            f"checkpoint_upload_fn must return the uploaded lockstep.Checkpoint, got {type(uploaded).__name__}; "
            "e.g. return Checkpoint(uri) for the place it copied the files to."
        )
    if (job.delete_local or given_goes) and uploaded == checkpoint:
        raise ValueError(
            f"checkpoint_upload_fn returned the checkpoint it was given ({checkpoint.uri}), whose folder is "
            "deleted after the upload (delete_local_checkpoint_after_upload, or the staged copy of an ASYNC "
            "upload); return a Checkpoint of the uploaded copy."
        )
    standard = context.storage.checkpoint_of(CheckpointEntry(job.dir_name, 0))
    return (None if uploaded == standard else uploaded.uri), None


def write_checkpoint(context: TrainContext, local_dir: str, dir_name: str) -> list[FileSum] | None:
    """Copy this rank's files into the checkpoint folder, naming the checkpoint on failure (a
    full or unreachable storage keeps its error class); each file's size and checksum."""
    try:
        return context.storage.write_checkpoint(local_dir, dir_name)
    except (StorageFullError, StorageUnreachableError) as error:
        raise type(error)(f"rank {context.world_rank}: checkpoint {dir_name}: {error}") from error
    except Exception as error:
        raise OSError(
            f"rank {context.world_rank}: writing checkpoint {dir_name} to "
            f"{context.storage.checkpoint_path(dir_name)} failed: {type(error).__name__}: {error}"
        ) from error


def check_deletable(checkpoint: Checkpoint, storage: RunStorage) -> None:
    """Refuse ``delete_local_checkpoint_after_upload`` where deleting the folder would delete
    the run folder, or a folder inside it.

    Raises:
        ValueError: the checkpoint folder contains the run folder or lies inside it.
    """
    if not (checkpoint.is_local and is_local(storage.filesystem)):
        return
    folder, run = os.path.realpath(checkpoint.path), os.path.realpath(storage.run_path)
    if os.path.commonpath([folder, run]) in (folder, run):
        raise ValueError(
            f"report(delete_local_checkpoint_after_upload=True): the checkpoint folder {checkpoint.path} "
            f"{'contains' if os.path.commonpath([folder, run]) == folder else 'is inside'} the run folder "
            f"{storage.run_path}, so deleting it would delete run files. Write the checkpoint to a temporary "
            "folder (tempfile.mkdtemp()), or pass delete_local_checkpoint_after_upload=False."
        )


def delete_local(checkpoint: Checkpoint) -> None:
    """Remove a local checkpoint folder after its upload; a remote one is left alone (a failure
    to delete is logged, not raised: the upload itself succeeded)."""
    if not checkpoint.is_local:
        logger.debug("not deleting %s after upload: it is not a local folder", checkpoint.uri)
        return
    try:
        shutil.rmtree(checkpoint.path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("could not delete the local checkpoint %s after its upload: %s", checkpoint.path, error)


class CheckpointUploader:
    """ASYNC uploads of one rank, in report order, on a background thread.

    ``submit`` takes a private copy of the checkpoint first (hard links where the filesystem
    allows, so it costs next to nothing), so the caller may delete its folder as soon as
    ``report()`` returns; files must not be rewritten in place before the upload ends. The
    upload (and a ``checkpoint_upload_fn``) works on that copy.
    """

    def __init__(self, context: TrainContext, channel: WorkerChannel) -> None:
        self._context = context
        self._channel = channel
        self._jobs: queue.Queue[tuple[int, Upload, str, str | None] | None] = queue.Queue()
        self._staged: list[tuple[int, Upload, str, str | None]] = []
        self._thread = threading.Thread(target=self._upload_loop, name="lockstep-checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, index: int, checkpoint: Checkpoint, job: Upload) -> None:
        """Stage ``checkpoint`` for report ``index``; its upload starts at :meth:`start_staged`."""
        staged = private_copy(checkpoint.path) if checkpoint.is_local else checkpoint.to_directory()
        self._staged.append((index, job, staged, checkpoint.path if checkpoint.is_local else None))

    def start_staged(self) -> None:
        """Start the uploads staged so far: called once the report that staged them is
        answered, so that the upload's copying doesn't slow that report's round trip."""
        for item in self._staged:
            self._jobs.put(item)
        self._staged.clear()

    def _upload_loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            index, job, staged, original = item
            error = external = files = None
            try:
                with PROGRESS.making_progress():
                    external, files = upload(self._context, Checkpoint.from_directory(staged), job, given_goes=True)
            except BaseException as failure:  # noqa: BLE001 - the driver must hear of every failed upload (SystemExit too)
                error = str(failure) if type(failure) is OSError else f"{type(failure).__name__}: {failure}"
                kept = _keep_failed_copy(staged, original) if job.delete_local else None
                if kept is not None:
                    error += f"; the checkpoint's files are kept in {kept}"
            finally:
                shutil.rmtree(staged, ignore_errors=True)
            message = protocol.CheckpointUploaded(
                rank=self._context.world_rank,
                index=index,
                dir_name=job.dir_name,
                error=error,
                external_path=external,
                files=files,
            )
            self._channel.send(message)

    def close(self) -> None:
        """Wait for the staged and queued uploads to end."""
        self.start_staged()
        self._jobs.put(None)
        self._thread.join()


def _keep_failed_copy(staged: str, original: str | None) -> str | None:
    """Keep the staged copy of a checkpoint whose upload failed, when its own folder was
    deleted at ``report()`` (delete_local_checkpoint_after_upload, ASYNC's default): as
    ``<folder>.lockstep_failed_upload`` beside it (a name of its own, when taken); where, or None."""
    if original is None or not os.path.isdir(staged):
        return None
    target = f"{original.rstrip(os.sep)}.lockstep_failed_upload"
    if os.path.exists(target):
        target = f"{target}_{uuid.uuid4().hex[:8]}"
    try:
        os.rename(staged, target)
    except OSError:
        return None
    return target
