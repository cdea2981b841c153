"""What a rank knows about itself (TrainContext) and the worker-side session behind
``report()``, ``get_checkpoint()`` and ``get_dataset_shard()``.

These functions work only inside a train function that lockstep runs; elsewhere they raise
``RuntimeError`` saying so.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal import protocol
from lockstep._internal.storage import RESERVED_NAMES, RunStorage
from lockstep.checkpoint import Checkpoint
from lockstep.errors import SessionNotActiveError


class CheckpointUploadMode(enum.Enum):
    """How ``report()`` persists a checkpoint.

    SYNC: the files are in storage when ``report()`` returns. ASYNC: ``report()`` returns once
    they are staged locally; they are uploaded in the background, in order, and the checkpoint
    counts (``Result.checkpoint``, ``get_checkpoint()``) once every rank's upload is done.
    NO_UPLOAD: the checkpoint is already where it should stay; it is registered at its path.
    """

    SYNC = "SYNC"
    ASYNC = "ASYNC"
    NO_UPLOAD = "NO_UPLOAD"


@dataclass(frozen=True)
class TrainContext:
    """Who this rank is in the run. Get it with :func:`lockstep.get_context` in a train function."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    storage: RunStorage
    metadata: dict[str, Any] = field(default_factory=dict)
    gpu_ids: tuple[str, ...] = ()

    def get_world_rank(self) -> int:
        """This worker's rank among all workers (0 … world_size-1)."""
        return self.world_rank

    def get_world_size(self) -> int:
        """How many workers the run has."""
        return self.world_size

    def get_local_rank(self) -> int:
        """This worker's rank among the workers on its node."""
        return self.local_rank

    def get_local_world_size(self) -> int:
        """How many workers run on this worker's node."""
        return self.local_world_size

    def get_node_rank(self) -> int:
        """The index of this worker's node."""
        return self.node_rank

    def get_experiment_name(self) -> str:
        """The run's name (``RunConfig.name``)."""
        return self.experiment_name

    def get_trial_name(self) -> str:
        """The run's name (kept for Ray Train compatibility)."""
        return self.experiment_name

    def get_storage(self) -> RunStorage:
        """The run folder: ``.run_path``, ``.filesystem``, ``.display_path``."""
        return self.storage

    def get_metadata(self) -> dict[str, Any]:
        """The ``metadata`` dict given to the trainer."""
        return dict(self.metadata)


class WorkerSession:
    """One rank's link to the driver while its train function runs."""

    def __init__(
        self,
        context: TrainContext,
        channel: protocol.WorkerChannel,
        first_report_index: int,
        checkpoint: Checkpoint | None,
        datasets: Mapping[str, Any],
        used_dir_names: Iterable[str] = (),
    ) -> None:
        self.context = context
        self._channel = channel
        self._next_report_index = first_report_index
        self._checkpoint = checkpoint
        self._datasets = dict(datasets)
        self._used_dir_names = set(used_dir_names)
        self._storage_checked = False
        self._uploader: CheckpointUploader | None = None

    def report(
        self,
        metrics: Mapping[str, Any],
        checkpoint: Checkpoint | None,
        checkpoint_dir_name: str | None,
        upload_mode: CheckpointUploadMode,
    ) -> None:
        """Send one report and wait until every rank has sent it and it is recorded."""
        metrics_json = encode_metrics(metrics)
        index = self._next_report_index
        message = protocol.Report(self.context.world_rank, index, metrics_json if self.context.world_rank == 0 else None)
        if checkpoint is not None:
            dir_name = self._new_dir_name(checkpoint_dir_name, index)
            state, external = self._persist(checkpoint, dir_name, index, upload_mode)
            message = dataclasses.replace(
                message, checkpoint_dir_name=dir_name, checkpoint_state=state, external_path=external
            )
        self._channel.send(message)
        done = self._channel.recv()
        self._next_report_index = index + 1
        if done.new_latest_checkpoint is not None:
            self._checkpoint = self.context.storage.checkpoint_of(done.new_latest_checkpoint)

    def _new_dir_name(self, checkpoint_dir_name: str | None, index: int) -> str:
        name = _checked_dir_name(checkpoint_dir_name, index)
        if name in self._used_dir_names:
            raise ValueError(
                f"report(checkpoint_dir_name={name!r}): this run already has a checkpoint of that name; "
                "give each report's checkpoint its own name (e.g. include the epoch), or leave it out."
            )
        self._used_dir_names.add(name)
        return name

    def _persist(
        self, checkpoint: Checkpoint, dir_name: str, index: int, upload_mode: CheckpointUploadMode
    ) -> tuple[str, str | None]:
        """Put this rank's checkpoint files where they belong; return (state, external path)."""
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"report(checkpoint=...) takes a lockstep.Checkpoint, got {type(checkpoint).__name__}; "
                "use Checkpoint.from_directory(folder)."
            )
        if upload_mode is CheckpointUploadMode.NO_UPLOAD:
            return "external", checkpoint.uri
        self._check_shared_storage()
        self._channel.send(protocol.WritingCheckpoint(self.context.world_rank, dir_name))
        if upload_mode is CheckpointUploadMode.ASYNC:
            if self._uploader is None:
                self._uploader = CheckpointUploader(self.context, self._channel)
            self._uploader.submit(index, dir_name, checkpoint)
            return "uploading", None
        with checkpoint.as_directory() as local_dir:
            write_checkpoint(self.context, local_dir, dir_name)
        return "written", None

    def _check_shared_storage(self) -> None:
        """The driver's run record must be visible here, or checkpoint files would land
        somewhere the driver never looks."""
        if self._storage_checked:
            return
        storage = self.context.storage
        if not storage.has_record():
            raise RuntimeError(
                f"rank {self.context.world_rank} can't see the run folder {storage.display_path} that the driver "
                "created. On a cluster, storage_path must be shared by every node: an NFS path or cloud "
                "storage such as s3://bucket/prefix."
            )
        self._storage_checked = True

    def wait_for_uploads(self) -> None:
        """Block until every ASYNC checkpoint upload of this rank has ended."""
        if self._uploader is not None:
            self._uploader.close()

    def get_checkpoint(self) -> Checkpoint | None:
        """The latest committed checkpoint (at start: the one to resume from)."""
        return self._checkpoint

    def get_dataset_shard(self, name: str) -> Any:
        """This rank's shard of the dataset passed as ``datasets={name: ...}``."""
        if name not in self._datasets:
            known = ", ".join(repr(key) for key in self._datasets) or "none"
            raise KeyError(f"get_dataset_shard({name!r}): no such dataset; the trainer got: {known}.")
        return self._datasets[name]


def write_checkpoint(context: TrainContext, local_dir: str, dir_name: str) -> None:
    """Copy this rank's files into the checkpoint folder, naming the checkpoint on failure."""
    try:
        context.storage.write_checkpoint(local_dir, dir_name)
    except Exception as error:
        raise OSError(
            f"rank {context.world_rank}: writing checkpoint {dir_name} to "
            f"{context.storage.checkpoint_path(dir_name)} failed: {type(error).__name__}: {error}"
        ) from error


class CheckpointUploader:
    """ASYNC uploads of one rank, in report order, on a background thread.

    ``submit`` takes a private copy of the checkpoint first (hard links where the filesystem
    allows, so it costs next to nothing), so the caller may delete its folder as soon as
    ``report()`` returns; files must not be rewritten in place before the upload ends.
    """

    def __init__(self, context: TrainContext, channel: protocol.WorkerChannel) -> None:
        self._context = context
        self._channel = channel
        self._jobs: queue.Queue[tuple[int, str, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._upload_loop, name="lockstep-checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, index: int, dir_name: str, checkpoint: Checkpoint) -> None:
        """Queue the upload of ``checkpoint`` as ``dir_name`` for report ``index``."""
        if checkpoint.is_local:
            staged = _private_copy(checkpoint.path)
        else:
            staged = checkpoint.to_directory()
        self._jobs.put((index, dir_name, staged))

    def _upload_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            index, dir_name, staged = job
            error = None
            try:
                write_checkpoint(self._context, staged, dir_name)
            except OSError as failure:
                error = str(failure)
            finally:
                shutil.rmtree(staged, ignore_errors=True)
            self._channel.send(protocol.CheckpointUploaded(self._context.world_rank, index, dir_name, error))

    def close(self) -> None:
        """Wait for the queued uploads to end."""
        self._jobs.put(None)
        self._thread.join()


def _private_copy(folder: str) -> str:
    """A copy of ``folder`` that survives its deletion: hard links when possible, else a copy."""
    parent = os.path.dirname(os.path.abspath(folder))
    try:
        staged = tempfile.mkdtemp(prefix=".lockstep_upload_", dir=parent)
        shutil.copytree(folder, staged, copy_function=os.link, dirs_exist_ok=True)
    except OSError:
        staged = tempfile.mkdtemp(prefix="lockstep_upload_")
        shutil.copytree(folder, staged, dirs_exist_ok=True)
    return staged


def _checked_dir_name(checkpoint_dir_name: str | None, index: int) -> str:
    if checkpoint_dir_name is None:
        return f"checkpoint_{index:06d}"
    name = str(checkpoint_dir_name)
    if not name or "/" in name or "\\" in name or name.startswith(".") or name in RESERVED_NAMES:
        raise ValueError(
            f"checkpoint_dir_name={checkpoint_dir_name!r} must be a plain folder name (no '/', not starting "
            f"with '.', not one of {', '.join(sorted(RESERVED_NAMES))})."
        )
    return name


def encode_metrics(metrics: Mapping[str, Any]) -> str:
    """Check the metrics of a report and return them as JSON.

    Tensors and numpy scalars with one element become plain numbers.

    Raises:
        TypeError: ``metrics`` is not a dict, a key is not a string, or a value can't be saved.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"report() takes a dict of metrics, got {type(metrics).__name__}.")
    plain: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"report(): metric names must be strings, got the key {key!r} ({type(key).__name__}).")
        plain[key] = _plain_value(value, key)
    return json.dumps(plain)


def _plain_value(value: Any, key: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain_value(v, key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_value(item, key) for item in value]
    if _is_one_element_array(value):
        return _plain_value(value.item(), key)
    raise TypeError(
        f"report(): metric {key!r} is a {type(value).__name__}, which can't be saved; report numbers, "
        "strings, or lists/dicts of them (use tensor.item() for a scalar tensor)."
    )


def _is_one_element_array(value: Any) -> bool:
    numel = getattr(value, "numel", None)
    if callable(numel):
        return numel() == 1
    return getattr(value, "size", None) == 1 and hasattr(value, "item")


# -- the session of this process -----------------------------------------------------------------

_session: WorkerSession | None = None


def set_session(session: WorkerSession | None) -> None:
    """Install (or clear) this process's worker session. Called by the worker runtime."""
    global _session
    _session = session


def current_session() -> WorkerSession | None:
    """The session of the train function running in this process, or None outside one."""
    return _session


def active_session(caller: str) -> WorkerSession:
    """The session of the train function running in this process.

    Raises:
        SessionNotActiveError: called outside a train function run by lockstep.
    """
    if _session is None:
        raise SessionNotActiveError(
            f"lockstep.{caller}() works only inside the train function that TorchTrainer.fit() runs; "
            "call it from train_loop_per_worker."
        )
    return _session


def report(
    metrics: Mapping[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: CheckpointUploadMode | str = CheckpointUploadMode.SYNC,
) -> None:
    """Report metrics (and optionally a checkpoint) for this step; a collective.

    Every rank must call ``report()`` the same number of times: it returns when all ranks have
    called it, rank 0's metrics are recorded and every rank's checkpoint files are merged into
    one checkpoint folder in storage. The local folder may be deleted as soon as it returns.

    Args:
        metrics: A dict of numbers/strings (scalar tensors are converted).
        checkpoint: Files to save with this report, see :meth:`Checkpoint.from_directory`.
        checkpoint_dir_name: Folder name for the checkpoint (default ``checkpoint_<index>``);
            the same on every rank.
        checkpoint_upload_mode: SYNC (default), ASYNC or NO_UPLOAD, see :class:`CheckpointUploadMode`.
    """
    mode = CheckpointUploadMode(checkpoint_upload_mode)
    active_session("report").report(metrics, checkpoint, checkpoint_dir_name, mode)


def get_context() -> TrainContext:
    """This rank's :class:`TrainContext` (world rank, world size, local rank, …)."""
    return active_session("get_context").context


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint to resume from: the latest committed one, else ``resume_from_checkpoint``."""
    return active_session("get_checkpoint").get_checkpoint()


def get_dataset_shard(name: str) -> Any:
    """This rank's shard of ``datasets[name]``: map-style datasets are split into equal,
    disjoint parts, one per rank (see :class:`lockstep.data.DatasetShard`)."""
    return active_session("get_dataset_shard").get_dataset_shard(name)
