"""The worker-side session behind ``report()``, ``get_checkpoint()`` and ``get_dataset_shard()``:
one per rank, talking to the driver over the rank's channel."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from lockstep._internal.persist.manifest import FileSum
from lockstep._internal.persist.storage import RESERVED_NAMES
from lockstep._internal.rank.checkpoint_upload import (
    CheckpointUploader,
    Upload,
    UploadFn,
    check_deletable,
    delete_local,
    upload,
)
from lockstep._internal.rank.metrics_json import encode_metrics
from lockstep._internal.rank.progress import PROGRESS
from lockstep._internal.rank.progress_sender import where_i_am
from lockstep._internal.rank.step_timing import CLOCK
from lockstep._internal.rank.train_context import CheckpointUploadMode, TrainContext
from lockstep._internal.wire import protocol
from lockstep._internal.wire.channel import WorkerChannel
from lockstep.checkpoint import Checkpoint
from lockstep.preemption import PreemptionInfo
from lockstep.reported_checkpoint import ReportedCheckpoint, ReportedCheckpointStatus
from lockstep.validation import ValidationTaskConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerSession:
    """One rank's link to the driver while its train function runs.

    Attributes:
        calls: Held from sending a call to the driver until its answer came (the rank's
            progress thread reads the channel only while nobody holds it).
    """

    def __init__(
        self,
        context: TrainContext,
        channel: WorkerChannel,
        first_report_index: int,
        checkpoint: Checkpoint | None,
        datasets: Mapping[str, Any],
        used_dir_names: Iterable[str] = (),
        has_validation: bool = False,
        every_rank_metrics: bool = False,
    ) -> None:
        self.context = context
        self.has_validation = has_validation
        self._every_rank_metrics = every_rank_metrics
        self._channel = channel
        self._next_report_index = first_report_index
        self._checkpoint = checkpoint
        self._datasets = dict(datasets)
        self._used_dir_names = set(used_dir_names)
        self._storage_checked = False
        self._uploader: CheckpointUploader | None = None
        self._next_collective_seq = 0
        self.preemption_info: PreemptionInfo | None = None
        self.calls = threading.Lock()
        CLOCK.restart()

    def report(
        self,
        metrics: Mapping[str, Any],
        checkpoint: Checkpoint | None,
        checkpoint_dir_name: str | None,
        upload_mode: CheckpointUploadMode,
        upload_fn: UploadFn | None = None,
        delete_local_after_upload: bool = False,
        validation: Any = False,
    ) -> None:
        """Send one report and wait until every rank has sent it and it is recorded."""
        metrics_json = encode_metrics(metrics)
        PROGRESS.mark()
        request = validation_request(validation, checkpoint, self.has_validation)
        index = self._next_report_index
        sends_metrics = self.context.world_rank == 0 or self._every_rank_metrics
        message = protocol.Report(self.context.world_rank, index, metrics_json if sends_metrics else None)
        if checkpoint is not None:
            job = Upload(self._new_dir_name(checkpoint_dir_name, index), upload_fn, delete_local_after_upload)
            state, external, files = self._persist(checkpoint, job, index, upload_mode)
            message = dataclasses.replace(
                message,
                checkpoint_dir_name=job.dir_name,
                checkpoint_state=state,
                external_path=external,
                validation=request,
                files=files,
            )
        try:
            done = self._call(dataclasses.replace(message, step_times=CLOCK.close_window()), protocol.ReportDone)
        finally:
            if self._uploader is not None:
                self._uploader.start_staged()
        CLOCK.report_ns += time.perf_counter_ns() - CLOCK.window_start_ns
        self._next_report_index = index + 1
        if done.new_latest_checkpoint is not None:
            self._checkpoint = self.context.storage.checkpoint_of(done.new_latest_checkpoint)
        self._take_preemption_notice(done)

    def _take_preemption_notice(self, done: protocol.ReportDone) -> None:
        """Keep the run's preemption notice; stop here when the driver says the run stops.
        Without a notice, the driver stopped the run (``RunConfig(stop=...)``, a callback): the
        rank first waits for its checkpoint uploads, so that the driver can commit them.

        Raises:
            PreemptionStop: the run stops at this report.
        """
        from lockstep._internal.run.preemption import PreemptionStop, info_from

        if done.preempted is not None:
            self.preemption_info = info_from(done.preempted)
        if done.stop and done.preempted is None:
            self.wait_for_uploads()
            raise PreemptionStop(f"the driver stopped the run after report #{done.index}")
        if done.stop:
            raise PreemptionStop(f"the run stops after report #{done.index} (preempted)")

    def _call(self, message: Any, kind: type[T]) -> T:
        """Send ``message`` and wait for the driver's answer, a ``kind``."""
        with self.calls:
            self._channel.send(message)
            return self._answer(kind)

    def _answer(self, kind: type[T]) -> T:
        """The driver's answer to the call just sent (calls and answers alternate; a
        StacksWanted meanwhile is answered here). After a preemption notice, a channel the driver
        closed means the run stopped (preempted)."""
        answer = self._receive()
        while isinstance(answer, protocol.StacksWanted):
            self._channel.send(where_i_am(self.context.world_rank))
            answer = self._receive()
        if not isinstance(answer, kind):
            raise RuntimeError(
                f"the driver sent {type(answer).__name__} where a {kind.__name__} was due (a lockstep bug)"
            )
        return answer

    def _receive(self) -> Any:
        try:
            return self._channel.recv()
        except (EOFError, OSError) as error:
            if self.preemption_info is None:
                raise
            from lockstep._internal.run.preemption import PreemptionStop

            raise PreemptionStop("the driver stopped the run (preempted)") from error

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
        self, checkpoint: Checkpoint, job: Upload, index: int, upload_mode: CheckpointUploadMode
    ) -> tuple[str, str | None, list[FileSum] | None]:
        """Put this rank's checkpoint files where they belong; return (state, external path,
        each file's path, size and checksum when lockstep copied them into the run folder).
        However long that takes, the rank is making progress (not hung).

        The local folder goes after a SYNC upload succeeded, and for ASYNC once it is staged
        (the upload reads lockstep's staged copy, and removing the folder later, from the
        background, could remove files a following report has written into the same folder).
        """
        with PROGRESS.making_progress():
            return self._persist_now(checkpoint, job, index, upload_mode)

    def _persist_now(
        self, checkpoint: Checkpoint, job: Upload, index: int, upload_mode: CheckpointUploadMode
    ) -> tuple[str, str | None, list[FileSum] | None]:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"report(checkpoint=...) takes a lockstep.Checkpoint, got {type(checkpoint).__name__}; "
                "use Checkpoint.from_directory(folder)."
            )
        if upload_mode is CheckpointUploadMode.NO_UPLOAD:
            if job.upload_fn is not None or job.delete_local:
                logger.warning(
                    "report(checkpoint_upload_mode=NO_UPLOAD) uploads nothing: checkpoint_upload_fn and "
                    "delete_local_checkpoint_after_upload are not used."
                )
            return "external", checkpoint.uri, None
        if job.delete_local:
            check_deletable(checkpoint, self.context.storage)
        self._check_shared_storage()
        self._channel.send(protocol.WritingCheckpoint(self.context.world_rank, job.dir_name))
        if upload_mode is CheckpointUploadMode.ASYNC:
            if self._uploader is None:
                self._uploader = CheckpointUploader(self.context, self._channel)
            self._uploader.submit(index, checkpoint, job)
            state, external, files = "uploading", None, None
        else:
            external, files = upload(self.context, checkpoint, job)
            state = "written" if external is None else "external"
        if job.delete_local:
            delete_local(checkpoint)
        return state, external, files

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

    def get_all_reported_checkpoints(
        self, validated: bool = False, timeout_s: float | None = None
    ) -> list[ReportedCheckpoint]:
        """The run's kept checkpoints, once those of this rank's reports so far are committed
        (and, when ``validated``, no validation is pending), or as they are after ``timeout_s``."""
        query = protocol.CheckpointsQuery(self.context.world_rank, self._next_report_index, validated, timeout_s)
        answer = self._call(query, protocol.ReportedCheckpoints)
        storage = self.context.storage
        return [
            ReportedCheckpoint(
                storage.checkpoint_of(entry),
                dict(entry.metrics),
                ReportedCheckpointStatus(entry.validation or ReportedCheckpointStatus.COMMITTED.value),
            )
            for entry in answer.checkpoints
        ]

    def collective(self, op: str, data: bytes | None = None) -> bytes | None:
        """Enter the next collective (``"barrier"`` or ``"broadcast"``) and wait for every rank
        to enter it; return rank 0's ``data``."""
        seq = self._next_collective_seq
        self._next_collective_seq += 1
        PROGRESS.mark()
        entered = time.perf_counter_ns()
        answer = self._call(protocol.Collective(self.context.world_rank, seq, op, data), protocol.CollectiveDone)
        CLOCK.collective_ns += time.perf_counter_ns() - entered
        return answer.data

    def get_dataset_shard(self, dataset_name: str | None = None) -> Any:
        """This rank's shard of the dataset passed as ``datasets={dataset_name: ...}``; with no
        name, of the only dataset passed. See :func:`get_dataset_shard`."""
        return self._datasets[self._dataset_name(dataset_name)]

    def _dataset_name(self, dataset_name: str | None) -> str:
        known = ", ".join(repr(key) for key in self._datasets) or "none"
        if dataset_name is None:
            if len(self._datasets) != 1:
                raise ValueError(
                    f"get_dataset_shard() without a name needs exactly one dataset, but the trainer got: {known}; "
                    "name the one you want, e.g. get_dataset_shard('train')."
                )
            return next(iter(self._datasets))
        if dataset_name not in self._datasets:
            raise KeyError(f"get_dataset_shard({dataset_name!r}): no such dataset; the trainer got: {known}.")
        return dataset_name


def validation_request(validation: Any, checkpoint: Checkpoint | None, has_validation: bool) -> Any:
    """What ``report(validation=...)`` asks for, as it travels to the driver and stays in the run
    record: None (no validation), True (the trainer's defaults), or a dict of a
    ValidationTaskConfig's ``fn_kwargs`` and ``timeout_s``.

    Raises:
        TypeError: ``validation`` is not a bool or a ValidationTaskConfig, or its ``fn_kwargs``
            can't be written as JSON.
        ValueError: no checkpoint to validate, or the trainer has no ``validation_config``.
    """
    if validation is None or validation is False:
        return None
    if validation is not True and not isinstance(validation, ValidationTaskConfig):
        raise TypeError(
            f"report(validation=...) takes True, False or a lockstep.ValidationTaskConfig, got {validation!r}."
        )
    if checkpoint is None:
        raise ValueError("report(validation=...) needs a checkpoint to validate: pass checkpoint=... with it.")
    if not has_validation:
        raise ValueError(
            "report(validation=...): the trainer has no validation function; pass "
            "TorchTrainer(..., validation_config=lockstep.ValidationConfig(fn=...))."
        )
    if validation is True:
        return True
    try:
        fn_kwargs = json.loads(json.dumps(validation.fn_kwargs))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"report(validation=ValidationTaskConfig(fn_kwargs=...)): the fn_kwargs must be JSON-serializable "
            f"(numbers, strings, lists and dicts of them), as in Ray Train: {error}. Put other objects in "
            "ValidationConfig(task_config=...)'s defaults, or make them inside the validation function."
        ) from error
    return {"fn_kwargs": fn_kwargs, "timeout_s": validation.timeout_s}


def _checked_dir_name(checkpoint_dir_name: str | None, index: int) -> str:
    if checkpoint_dir_name is None or checkpoint_dir_name == "":  # "" too, as in Ray Train: the default name
        return f"checkpoint_{index:06d}"
    name = str(checkpoint_dir_name)
    if not name or "/" in name or "\\" in name or name.startswith(".") or name in RESERVED_NAMES:
        raise ValueError(
            f"checkpoint_dir_name={checkpoint_dir_name!r} must be a plain folder name (no '/', not starting "
            f"with '.', not one of {', '.join(sorted(RESERVED_NAMES))})."
        )
    return name
