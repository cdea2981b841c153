"""lockstep: run a PyTorch training function on several workers, with Ray Train's API.

A Ray Train script moves over by changing imports::

    import lockstep as train                    # was: import ray.train as train
    from lockstep.torch import TorchTrainer     # was: from ray.train.torch import TorchTrainer
    from lockstep import session                # was: from ray.air import session

Importing ``lockstep`` is light: ``lockstep.torch``, ``lockstep.lightning``,
``lockstep.huggingface`` and ``lockstep.collective`` are imported on first use (the first three
import torch or the framework they integrate). Which of Ray Train's names lockstep provides is
listed in ``lockstep._internal.ray_compat.ray_names``.
"""

# ruff: noqa: E402 - the imports below come after the warm start, on purpose

# In a script (python train.py), start the warm worker process now, beside the script's imports
# (lockstep._internal.early_warm; LOCKSTEP_WARM_START=0 turns it off).
from lockstep._internal.early_warm import start_for_script as _start_for_script

_start_for_script()

from lockstep import config, session
from lockstep.backend import BackendConfig
from lockstep.checkpoint import Checkpoint
from lockstep.config import (
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
    SyncConfig,
)
from lockstep.context import (
    CheckpointUploadMode,
    TrainContext,
    get_checkpoint,
    get_context,
    get_dataset_shard,
    get_preemption_info,
    report,
)
from lockstep.errors import (
    CheckpointCorruptedError,
    ControllerError,
    HangUp,
    NCCLHangError,
    PreemptionError,
    SessionNotActiveError,
    StorageFullError,
    StorageUnreachableError,
    TrainingFailedError,
    WorkerError,
    WorkerFailure,
    WorkerGroupError,
)
from lockstep.preemption import PreemptionInfo
from lockstep.result import Result
from lockstep.validation import ValidationConfig, ValidationFn, ValidationTaskConfig

__version__ = "0.1.0"

#: The key of the training dataset in ``datasets=`` (Ray Train's constant).
TRAIN_DATASET_KEY = "train"


def release_kept_actors() -> None:
    """Release now the Ray actors (and placement group) that lockstep keeps, idle, between the
    fits of this driver for the next ``fit()`` of the same shape; they are otherwise released
    after 5 minutes unused, at exit, or when a fit asks for another shape. Nothing happens
    when none are kept."""
    from lockstep._internal.executors.ray_pool import release_kept_actors as release

    release()


#: Names imported on first use: name -> the module that defines it.
_LAZY_NAMES = {
    "get_all_reported_checkpoints": "lockstep.context",
    "ReportedCheckpoint": "lockstep.reported_checkpoint",
    "ReportedCheckpointStatus": "lockstep.reported_checkpoint",
    "CheckpointConsistencyMode": "lockstep.reported_checkpoint",
    "UserCallback": "lockstep.callbacks",
}
_LAZY_MODULES = ("torch", "lightning", "huggingface", "collective")

__all__ = [
    "TRAIN_DATASET_KEY",
    "BackendConfig",
    "Checkpoint",
    "CheckpointCorruptedError",
    "CheckpointConfig",
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ControllerError",
    "DataConfig",
    "FailureConfig",
    "HangUp",
    "LoggingConfig",
    "NCCLHangError",
    "PreemptionError",
    "PreemptionInfo",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "SessionNotActiveError",
    "StorageFullError",
    "StorageUnreachableError",
    "SyncConfig",
    "TrainContext",
    "TrainingFailedError",
    "UserCallback",
    "ValidationConfig",
    "ValidationFn",
    "ValidationTaskConfig",
    "WorkerError",
    "WorkerFailure",
    "WorkerGroupError",
    "config",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "release_kept_actors",
    "report",
    "session",
]


def __getattr__(name: str) -> object:
    """``lockstep.torch`` & co, and the names of ``_LAZY_NAMES``, imported on first use, so that
    ``import lockstep`` alone imports neither torch nor the integrated frameworks."""
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f"lockstep.{name}")
    if name in _LAZY_NAMES:
        module = importlib.import_module(_LAZY_NAMES[name])
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY_MODULES))
