"""lockstep: run a PyTorch training function on several workers, with Ray Train's API.

A Ray Train script moves over by changing imports::

    import lockstep as train                    # was: import ray.train as train
    from lockstep.torch import TorchTrainer     # was: from ray.train.torch import TorchTrainer
    from lockstep import session                # was: from ray.air import session

Importing ``lockstep`` is light; ``lockstep.torch`` imports torch.
"""

from lockstep import config, session
from lockstep.checkpoint import Checkpoint
from lockstep.config import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from lockstep.context import (
    CheckpointUploadMode,
    TrainContext,
    get_checkpoint,
    get_context,
    get_dataset_shard,
    report,
)
from lockstep.errors import SessionNotActiveError, TrainingFailedError, WorkerFailure
from lockstep.result import Result

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointUploadMode",
    "DataConfig",
    "FailureConfig",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "SessionNotActiveError",
    "TrainContext",
    "TrainingFailedError",
    "WorkerFailure",
    "config",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
    "session",
]


def __getattr__(name: str) -> object:
    """``lockstep.torch`` on first use, so ``import lockstep`` alone doesn't import torch."""
    if name == "torch":
        import importlib

        return importlib.import_module("lockstep.torch")
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
