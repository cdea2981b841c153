"""What a train function calls: ``report()``, ``get_context()`` (a :class:`TrainContext`),
``get_checkpoint()``, ``get_dataset_shard()``, ``get_all_reported_checkpoints()``,
``get_preemption_info()``. Each asks
this process's worker session (:mod:`lockstep._internal.rank.worker_session`).

These functions work only inside a train function that lockstep runs; elsewhere they raise
``RuntimeError`` saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lockstep._internal.rank.session_state import active_session
from lockstep._internal.rank.train_context import CheckpointUploadMode, TrainContext
from lockstep.checkpoint import Checkpoint
from lockstep.reported_checkpoint import (  # noqa: F401 - ReportedCheckpointStatus: importable from here too
    CheckpointConsistencyMode,
    ReportedCheckpoint,
    ReportedCheckpointStatus,
)
from lockstep.validation import ValidationTaskConfig

if TYPE_CHECKING:
    from lockstep._internal.rank.checkpoint_upload import UploadFn
    from lockstep.preemption import PreemptionInfo

__all__ = [
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "TrainContext",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "report",
]


def report(
    metrics: Mapping[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: CheckpointUploadMode | str = CheckpointUploadMode.SYNC,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: UploadFn | None = None,
    validation: bool | ValidationTaskConfig = False,
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
        delete_local_checkpoint_after_upload: Remove the checkpoint's local folder once it is
            uploaded (a remote checkpoint is never deleted). Default, as in Ray Train: True for
            ASYNC, False otherwise. With ASYNC the folder goes when ``report()`` returns, since
            lockstep uploads from its own staged copy. Unused with NO_UPLOAD (nothing is uploaded).
        checkpoint_upload_fn: ``fn(checkpoint, checkpoint_dir_name) -> Checkpoint`` uploads this
            rank's checkpoint itself (on the upload thread with ASYNC) instead of lockstep
            copying it into the run folder; the Checkpoint it returns is what the run records
            (``Result.checkpoint``, ``get_checkpoint()``). If it is not the run's folder
            ``checkpoint_dir_name``, it is registered where it is, as with NO_UPLOAD (Ray Train
            refuses a place outside its run folder), and not deleted by ``num_to_keep``; every
            rank should then return the same one (only one is recorded).
        validation: Validate this report's checkpoint once it is committed, with the trainer's
            ``validation_config`` (see :mod:`lockstep.validation`): True uses its defaults; a
            :class:`~lockstep.ValidationTaskConfig` gives ``fn_kwargs`` (merged over the
            defaults) and ``timeout_s``. ``report()`` does not wait for it. Of the ranks that
            pass a checkpoint, the lowest rank's ``validation`` counts (as in Ray Train).

    Raises:
        ValueError: ``delete_local_checkpoint_after_upload`` would delete the run folder or a
            folder inside it; ``validation`` without a checkpoint, or without a
            ``validation_config`` on the trainer.
    """
    mode = CheckpointUploadMode(checkpoint_upload_mode)
    delete_local = (
        mode is CheckpointUploadMode.ASYNC
        if delete_local_checkpoint_after_upload is None
        else bool(delete_local_checkpoint_after_upload)
    )
    active_session("report").report(
        metrics,
        checkpoint,
        checkpoint_dir_name=checkpoint_dir_name,
        upload_mode=mode,
        upload_fn=checkpoint_upload_fn,
        delete_local_after_upload=delete_local,
        validation=validation,
    )


def get_all_reported_checkpoints(
    consistency_mode: CheckpointConsistencyMode | str = CheckpointConsistencyMode.VALIDATED,
    timeout_s: float | None = None,
) -> list[ReportedCheckpoint]:
    """The run's checkpoints so far, each with the metrics reported with it.

    Not a collective: each rank may call it on its own. It asks the driver, which answers once
    the checkpoints of every ``report()`` this rank has made are committed, so a checkpoint
    whose ASYNC upload is still running is waited for (a failed upload fails the run instead).

    Which and in what order, as in Ray Train 2.60: the checkpoints the run keeps, so those
    deleted by ``CheckpointConfig(num_to_keep=...)`` are not listed (the latest always is); in
    report order, or worst to best by ``checkpoint_score_attribute`` when one is set.
    Checkpoints of earlier attempts (before a restart) and of an earlier run that this one
    resumed are included. Each has its ``status``: COMMITTED (no validation asked for),
    PENDING_VALIDATION, VALIDATED (its metrics include the validation's), VALIDATION_FAILED or
    VALIDATION_TIMEOUT.

    Example:
        >>> for reported in lockstep.get_all_reported_checkpoints():  # doctest: +SKIP
        ...     print(reported.metrics["loss"], reported.checkpoint.path)

    Args:
        consistency_mode: COMMITTED waits for the commits; VALIDATED (the default, as in Ray
            Train) also until no validation is pending (with no ``validation_config``, nothing
            can end one, so it waits as COMMITTED).
        timeout_s: Wait at most this long, then return the checkpoints as they are; None: no limit.
    """
    mode = CheckpointConsistencyMode(consistency_mode)
    return active_session("get_all_reported_checkpoints").get_all_reported_checkpoints(
        validated=mode is CheckpointConsistencyMode.VALIDATED, timeout_s=timeout_s
    )


def get_context() -> TrainContext:
    """This rank's :class:`TrainContext` (world rank, world size, local rank, …)."""
    return active_session("get_context").context


def get_preemption_info() -> PreemptionInfo | None:
    """The run's preemption notice, or ``None`` while there is none (Ray Train 2.60's name).

    A SIGTERM to the driver or to a rank's process is a notice: every rank learns of it at its
    next ``report()`` (the same report on every rank, so ranks agree without talking), and the
    run stops once a checkpoint is committed after it, within
    ``FailureConfig.preemption_grace_s``. Report a checkpoint soon after a notice to lose
    nothing.

    Example:
        >>> for step in range(steps):                                  # doctest: +SKIP
        ...     train_step()
        ...     notice = lockstep.get_preemption_info()
        ...     checkpoint = save(step) if notice is not None or step % 1000 == 0 else None
        ...     lockstep.report({"step": step}, checkpoint=checkpoint)
    """
    return active_session("get_preemption_info").preemption_info


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint to resume from: the latest committed one, else ``resume_from_checkpoint``."""
    return active_session("get_checkpoint").get_checkpoint()


def get_dataset_shard(dataset_name: str | None = None) -> Any:
    """This rank's shard of ``datasets[dataset_name]``.

    Map-style torch datasets are split into equal, disjoint parts, one per rank (a
    :class:`lockstep.data.DatasetShard`); a ``ray.data.Dataset`` into streaming splits (Ray's
    ``DataIterator``, see :class:`lockstep.data.RayDataShard`). Both are read with Ray Data's
    ``iter_batches(...)`` / ``iter_torch_batches(...)`` arguments. Datasets left out of
    ``DataConfig(datasets_to_split=...)`` come whole.

    Args:
        dataset_name: The key in the trainer's ``datasets=``; None (the default) when the
            trainer got exactly one dataset.

    Raises:
        KeyError: the trainer got no dataset of that name.
        ValueError: no name was given, and the trainer got no dataset or several.
    """
    return active_session("get_dataset_shard").get_dataset_shard(dataset_name)
