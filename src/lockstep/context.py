"""What a rank knows about itself (TrainContext) and the worker-side session behind
``report()``, ``get_checkpoint()`` and ``get_dataset_shard()``.

These functions work only inside a train function that lockstep runs; elsewhere they raise
``RuntimeError`` saying so.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from lockstep._internal import protocol
from lockstep._internal.storage import RunStorage
from lockstep.checkpoint import Checkpoint
from lockstep.errors import SessionNotActiveError, TrainingFailedError


class CheckpointUploadMode(enum.Enum):
    """How ``report()`` persists a checkpoint. lockstep currently always does SYNC: the
    checkpoint is in storage when ``report()`` returns."""

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
    gpu_ids: tuple[int, ...] = ()

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
        connection: Connection,
        first_report_index: int,
        checkpoint: Checkpoint | None,
        datasets: Mapping[str, Any],
    ) -> None:
        self.context = context
        self._connection = connection
        self._next_report_index = first_report_index
        self._checkpoint = checkpoint
        self._datasets = dict(datasets)

    def report(self, metrics: Mapping[str, Any], checkpoint: Checkpoint | None, checkpoint_dir_name: str | None) -> None:
        """Send one report and wait until every rank has sent it and it is persisted."""
        metrics_json = encode_metrics(metrics)
        index = self._next_report_index
        dir_name = None
        if checkpoint is not None:
            dir_name = _checked_dir_name(checkpoint_dir_name, index)
            self._stage(checkpoint, dir_name)
        sent = metrics_json if self.context.world_rank == 0 else None
        self._connection.send(protocol.Report(self.context.world_rank, index, sent, dir_name))
        done = self._connection.recv()
        if done.error:
            raise TrainingFailedError(f"rank {self.context.world_rank}: report #{index} failed: {done.error}")
        self._next_report_index = index + 1
        if done.checkpoint_path is not None:
            self._checkpoint = Checkpoint(done.checkpoint_path, self.context.storage.filesystem)

    def _stage(self, checkpoint: Checkpoint, dir_name: str) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"report(checkpoint=...) takes a lockstep.Checkpoint, got {type(checkpoint).__name__}; "
                "use Checkpoint.from_directory(folder)."
            )
        with checkpoint.as_directory() as local_dir:
            self.context.storage.stage_checkpoint(local_dir, dir_name)

    def get_checkpoint(self) -> Checkpoint | None:
        """The latest committed checkpoint (at start: the one to resume from)."""
        return self._checkpoint

    def get_dataset_shard(self, name: str) -> Any:
        """This rank's shard of the dataset passed as ``datasets={name: ...}``."""
        if name not in self._datasets:
            known = ", ".join(repr(key) for key in self._datasets) or "none"
            raise KeyError(f"get_dataset_shard({name!r}): no such dataset; the trainer got: {known}.")
        return self._datasets[name]


def _checked_dir_name(checkpoint_dir_name: str | None, index: int) -> str:
    if checkpoint_dir_name is None:
        return f"checkpoint_{index:06d}"
    name = str(checkpoint_dir_name)
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(
            f"checkpoint_dir_name={checkpoint_dir_name!r} must be a plain folder name "
            "(no '/', not starting with '.')."
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
        checkpoint_upload_mode: Accepted for Ray Train compatibility; uploads are synchronous.
    """
    active_session("report").report(metrics, checkpoint, checkpoint_dir_name)


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
