"""The public names of Ray Train 2.60's ``ray.train``, ``ray.train.torch`` and ``ray.air.session``,
and what lockstep does with each: the one place that says it, read by ``tests/test_ray_names.py``
(which checks it against the code and against Ray's ``__all__``) and by the docs
(``docs/ray_train_api.md``).

Statuses:

- ``provided``: ``lockstep.<name>`` (or the module named in ``lockstep``) works; ``note`` says
  where lockstep's behaviour differs from Ray's.
- ``deprecated``: Ray Train deprecated it; lockstep's name imports and raises on use, with a
  message that says what to use instead (``note``).
- ``not provided``: importing it from lockstep fails; ``note`` says what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["provided", "deprecated", "not provided"]


@dataclass(frozen=True)
class NameStatus:
    """What lockstep does with one Ray Train name.

    Attributes:
        status: ``"provided"``, ``"deprecated"`` or ``"not provided"``.
        lockstep: Where it lives in lockstep (``"lockstep.report"``); "" when not provided.
        note: How it differs from Ray's, or what to use instead.
    """

    status: Status
    lockstep: str = ""
    note: str = ""


def _provided(where: str, note: str = "") -> NameStatus:
    return NameStatus("provided", where, note)


def _deprecated(where: str, note: str) -> NameStatus:
    return NameStatus("deprecated", where, note)


def _absent(note: str) -> NameStatus:
    return NameStatus("not provided", "", note)


RAY_TRAIN: dict[str, NameStatus] = {
    "get_checkpoint": _provided("lockstep.get_checkpoint"),
    "get_context": _provided("lockstep.get_context"),
    "get_dataset_shard": _provided("lockstep.get_dataset_shard"),
    "report": _provided(
        "lockstep.report", "every report is kept (with or without a checkpoint), not only those with one"
    ),
    "get_all_reported_checkpoints": _provided("lockstep.get_all_reported_checkpoints"),
    "BackendConfig": _provided(
        "lockstep.BackendConfig", "worker set-up/tear-down hooks: on_worker_start, on_worker_shutdown"
    ),
    "Checkpoint": _provided("lockstep.Checkpoint"),
    "CheckpointConfig": _provided(
        "lockstep.CheckpointConfig", "V1's checkpoint_frequency / checkpoint_at_end: only their 'off' values"
    ),
    "CheckpointUploadMode": _provided("lockstep.CheckpointUploadMode"),
    "DataConfig": _provided("lockstep.DataConfig"),
    "FailureConfig": _provided(
        "lockstep.FailureConfig",
        "fail_fast=True is accepted with max_failures=0; adds report_timeout_s and the hang detector's "
        "hang_timeout_s, hang_step_multiple, hang_first_step_timeout_s",
    ),
    "LoggingConfig": _provided("lockstep.LoggingConfig", "sets the level of the 'lockstep' logger in the driver"),
    "Result": _provided("lockstep.Result", "metrics is the last report, also without a checkpoint"),
    "RunConfig": _provided(
        "lockstep.RunConfig",
        "local_dir= works as storage_path=; stop= as Ray Tune's (metric >= "
        "threshold, or a function); sync_config=, progress_reporter=, worker_runtime_env= raise "
        "saying what to use",
    ),
    "ScalingConfig": _provided(
        "lockstep.ScalingConfig",
        "num_workers=0 is local mode; label_selector=, use_tpu=True, topology= raise (no node labels, no TPUs)",
    ),
    "TrainContext": _provided("lockstep.TrainContext"),
    "TrainingFailedError": _provided("lockstep.TrainingFailedError", "keeps .failures (rank -> WorkerFailure)"),
    "WorkerGroupError": _provided(
        "lockstep.WorkerGroupError",
        ".worker_failures values are lockstep.WorkerError "
        "(type name, message, traceback; an instance of the built-in class when it is one), "
        "not the rank's own exception object",
    ),
    "ControllerError": _provided("lockstep.ControllerError"),
    "NCCLHangError": _provided(
        "lockstep.NCCLHangError",
        "raised by the hang detector when a rank of the hang waits in an NCCL collective (named by torch's flight "
        "recorder), after max(60 s, 10 x the median step) rather than Ray's 600 s, with the stuck ranks as "
        "worker_failures; a GPU-only path not yet run on GPUs",
    ),
    "ReportedCheckpoint": _provided("lockstep.ReportedCheckpoint"),
    "ReportedCheckpointStatus": _provided("lockstep.ReportedCheckpointStatus"),
    "TRAIN_DATASET_KEY": _provided("lockstep.TRAIN_DATASET_KEY"),
    "SyncConfig": _deprecated(
        "lockstep.SyncConfig",
        "nothing to sync: ranks write checkpoints straight to "
        "RunConfig.storage_path (a shared folder or a URI such as s3://...)",
    ),
    "UserCallback": _provided(
        "lockstep.UserCallback",
        "after_report for a report with an ASYNC checkpoint comes once it is committed; after_exception gets "
        "lockstep.WorkerError values; lockstep.callbacks.Callback has more hooks (both kinds mix in "
        "RunConfig(callbacks=[...]))",
    ),
    "CheckpointConsistencyMode": _provided(
        "lockstep.CheckpointConsistencyMode",
        "VALIDATED waits as COMMITTED does when the trainer has no validation_config (nothing can end a "
        "pending validation)",
    ),
    "ValidationConfig": _provided(
        "lockstep.ValidationConfig",
        "on one machine each validation is a fresh process (ray_remote_kwargs: num_cpus, num_gpus, memory, "
        "max_retries, retry_exceptions, name; others need Ray); num_to_keep keeps the best validated checkpoints "
        "(Ray can delete the best before its validation ends); a preempted run's pending validations run at the "
        "next fit(), as an interrupted one's",
    ),
    "ValidationFn": _provided("lockstep.ValidationFn"),
    "ValidationTaskConfig": _provided(
        "lockstep.ValidationTaskConfig", "a wrong timeout_s raises ValueError (Ray: AssertionError)"
    ),
    "PreemptionError": _provided(
        "lockstep.PreemptionError",
        "a SIGTERM to the driver or to a rank is the notice; "
        "the run stops after its next committed checkpoint and fit() raises this; "
        "run the command again to continue (not counted as a failure). A Ray node "
        "drain is the notice for the ranks on that node",
    ),
    "PreemptionInfo": _provided(
        "lockstep.PreemptionInfo", "node ids are hostnames (for a Ray node drain, the node's IP)"
    ),
    "get_preemption_info": _provided(
        "lockstep.get_preemption_info", "no extra barrier: every rank learns the notice at the same report()"
    ),
}

RAY_TRAIN_TORCH: dict[str, NameStatus] = {
    "TorchTrainer": _provided("lockstep.torch.TorchTrainer"),
    "TorchConfig": _provided(
        "lockstep.torch.TorchConfig",
        "per-device backends such as 'cpu:gloo,cuda:nccl': whole with GPUs, the cpu: one on CPU workers",
    ),
    "get_device": _provided("lockstep.torch.get_device"),
    "get_devices": _provided("lockstep.torch.get_devices"),
    "prepare_model": _provided(
        "lockstep.torch.prepare_model",
        'parallel_strategy="fsdp" without FSDP1\'s arguments shards with FSDP2 (fully_shard, in place: no .module, '
        "state_dict() gives sharded DTensors; save with torch.distributed.checkpoint) where Ray wraps in FSDP1; "
        "FSDP1's arguments give FSDP1 on GPUs, as with Ray",
    ),
    "prepare_data_loader": _provided("lockstep.torch.prepare_data_loader"),
    "enable_reproducibility": _provided("lockstep.torch.enable_reproducibility"),
    "TorchCheckpoint": _deprecated(
        "lockstep.torch.TorchCheckpoint", "lockstep.Checkpoint with the state dict saved in its folder"
    ),
    "accelerate": _deprecated("lockstep.torch.accelerate", "torch.autocast and torch.amp.GradScaler directly"),
    "backward": _deprecated("lockstep.torch.backward", "loss.backward() (scaler.scale(loss).backward() with AMP)"),
    "prepare_optimizer": _deprecated("lockstep.torch.prepare_optimizer", "the optimizer as it is"),
}

RAY_AIR_SESSION: dict[str, NameStatus] = {
    **{
        name: _provided(f"lockstep.session.{name}")
        for name in (
            "report",
            "get_checkpoint",
            "get_dataset_shard",
            "get_metadata",
            "get_experiment_name",
            "get_world_size",
            "get_world_rank",
            "get_local_rank",
            "get_local_world_size",
            "get_node_rank",
        )
    },
    "get_trial_name": _provided("lockstep.session.get_trial_name", "the run's name"),
    "get_trial_id": _deprecated("lockstep.session.get_trial_id", "get_context().get_experiment_name()"),
    "get_run_id": _deprecated("lockstep.session.get_run_id", "get_context().get_experiment_name()"),
    "get_trial_dir": _deprecated("lockstep.session.get_trial_dir", "a folder passed in train_loop_config"),
    "get_trial_resources": _deprecated(
        "lockstep.session.get_trial_resources", "train_loop_config; lockstep.torch.get_device()"
    ),
}

#: Ray module -> its public names -> what lockstep does with each.
RAY_NAMES: dict[str, dict[str, NameStatus]] = {
    "ray.train": RAY_TRAIN,
    "ray.train.torch": RAY_TRAIN_TORCH,
    "ray.air.session": RAY_AIR_SESSION,
}
