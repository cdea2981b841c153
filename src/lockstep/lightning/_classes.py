"""The Lightning subclasses behind :mod:`lockstep.lightning`, built once per Lightning package.

Each class subclasses that package's own base (``DDPStrategy``, ``LightningEnvironment``,
``Callback``, …), so the package's ``Trainer`` accepts it. What they add:

- the strategies use the process group that lockstep's ``TorchConfig`` created in the worker
  (Lightning sees it initialised and does not create one), the worker's device
  (:func:`lockstep.torch.get_device`), and the run's ranks for distributed samplers;
- the cluster environment reads ranks and sizes from :func:`lockstep.get_context` and tells
  Lightning that lockstep started the processes (so it starts none);
- the callback reports the trainer's metrics and a Lightning checkpoint every train epoch.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep._internal.rank.progress import count_work
from lockstep._internal.rank.torch_devices import get_device
from lockstep.checkpoint import Checkpoint
from lockstep.context import CheckpointUploadMode, get_context, report
from lockstep.lightning._package import environments_module, trainer_module
from lockstep.validation import ValidationTaskConfig

logger = logging.getLogger(__name__)

#: The Lightning checkpoint's file name inside each reported checkpoint folder (as Ray Train's).
CHECKPOINT_NAME = "checkpoint.ckpt"
#: Strategy arguments that configure a process group, which lockstep's TorchConfig owns.
_PROCESS_GROUP_ARGUMENTS = ("process_group_backend", "timeout", "start_method")


@dataclass(frozen=True)
class LightningClasses:
    """lockstep's Lightning classes for one package, by the role they play."""

    package: str
    ddp: type
    fsdp: type
    deepspeed: type
    environment: type
    report_callback: type


@functools.cache
def classes_for(package: str) -> LightningClasses:
    """Build (once) lockstep's Lightning classes for ``package`` (``lightning`` or ``pytorch_lightning``)."""
    pl = trainer_module(package)
    strategies = pl.strategies
    environment = environments_module(package).LightningEnvironment
    return LightningClasses(
        package=package,
        ddp=_named("RayDDPStrategy", (_LockstepParallel, strategies.DDPStrategy)),
        fsdp=_named("RayFSDPStrategy", (_LockstepParallel, strategies.FSDPStrategy)),
        deepspeed=_named("RayDeepSpeedStrategy", (_NeedsDeepSpeed, _LockstepParallel, strategies.DeepSpeedStrategy)),
        environment=_named("RayLightningEnvironment", (_LockstepEnvironment, environment)),
        report_callback=_named("RayTrainReportCallback", (_ReportEachEpoch, pl.callbacks.Callback)),
    )


def _named(name: str, bases: tuple[type, ...]) -> type:
    """A class ``name`` made of ``bases`` (the first ones are lockstep's behaviour)."""

    def fill(namespace: dict[str, Any]) -> None:
        namespace.update(__module__=__name__, __qualname__=name)

    return types.new_class(name, bases, exec_body=fill)


# -- strategies ----------------------------------------------------------------------------------


class _LockstepParallel:
    """What every lockstep strategy changes in a Lightning parallel strategy."""

    world_size: int
    global_rank: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ignored = [name for name in _PROCESS_GROUP_ARGUMENTS if name in kwargs]
        if ignored:
            logger.warning(
                "%s(%s=...): ignored, lockstep's TorchConfig creates the process group; pass "
                "TorchTrainer(torch_config=TorchConfig(backend=..., timeout_s=...)) instead.",
                type(self).__name__,
                ", ".join(ignored),
            )
        super().__init__(*args, **kwargs)

    @property
    def root_device(self) -> torch.device:
        """The worker's device, as lockstep assigned it."""
        return get_device()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One sampler replica per lockstep worker."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """Check that lockstep's process group is there, then let Lightning set up the rest."""
        _require_process_group(self.world_size)
        # A single worker (lockstep's local mode) may have none: Lightning then makes one, which
        # teardown() removes again, with the variables Lightning set for it.
        self._lockstep_owned_group = None if _group_exists() else _rendezvous_variables()
        super().setup_environment()  # type: ignore[misc]

    def teardown(self) -> None:
        """Lightning's teardown; then remove a process group that Lightning made here."""
        super().teardown()  # type: ignore[misc]
        saved = getattr(self, "_lockstep_owned_group", None)
        if saved is not None and _group_exists():
            dist.destroy_process_group()
            _restore(saved)
        self._lockstep_owned_group = None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's step; each one counts as the rank's progress (for the hang detector)."""
        count_work()
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's validation step, counted as progress: validating is not hanging."""
        count_work()
        return super().validation_step(*args, **kwargs)  # type: ignore[misc]

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's test step, counted as progress."""
        count_work()
        return super().test_step(*args, **kwargs)  # type: ignore[misc]

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's predict step, counted as progress."""
        count_work()
        return super().predict_step(*args, **kwargs)  # type: ignore[misc]

    def _get_process_group_backend(self) -> str:
        if _group_exists():
            return str(dist.get_backend())
        return super()._get_process_group_backend()  # type: ignore[misc]


def _group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rendezvous_variables() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}


def _restore(variables: dict[str, str | None]) -> None:
    for name, value in variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _require_process_group(world_size: int) -> None:
    """With several workers, the process group must be lockstep's (a single one may let
    Lightning create its own)."""
    if world_size > 1 and not _group_exists():
        raise RuntimeError(
            f"lockstep's Lightning strategies run in a group of {world_size} workers, but no torch.distributed "
            "process group exists in this worker. Run the train function with lockstep.torch.TorchTrainer "
            "(its TorchConfig creates the group), not a trainer without a torch backend."
        )


class _NeedsDeepSpeed:
    """Fails at construction, with the fix, when DeepSpeed is not installed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ImportError(
                "RayDeepSpeedStrategy needs the deepspeed package, which is not installed: pip install deepspeed. "
                "Or use RayDDPStrategy or RayFSDPStrategy, which need nothing more.",
                name="deepspeed",
            )
        super().__init__(*args, **kwargs)


# -- cluster environment -------------------------------------------------------------------------


class _LockstepEnvironment:
    """Ranks and sizes come from lockstep's context; processes are lockstep's workers."""

    @property
    def creates_processes_externally(self) -> bool:
        """Always: lockstep started this worker, Lightning must start none."""
        return True

    def world_size(self) -> int:
        """The number of lockstep workers."""
        return get_context().get_world_size()

    def global_rank(self) -> int:
        """This worker's rank in the run."""
        return get_context().get_world_rank()

    def local_rank(self) -> int:
        """This worker's rank on its node."""
        return get_context().get_local_rank()

    def node_rank(self) -> int:
        """This worker's node."""
        return get_context().get_node_rank()

    def set_world_size(self, size: int) -> None:
        """Ignored: the size is lockstep's (Lightning computes one from devices and nodes)."""

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the rank is lockstep's."""

    def teardown(self) -> None:
        """Nothing to undo: lockstep owns the worker's environment variables."""


# -- reporting -----------------------------------------------------------------------------------


class _ReportEachEpoch:
    """At each train epoch end: ``report()`` the trainer's metrics with a Lightning checkpoint."""

    CHECKPOINT_NAME = CHECKPOINT_NAME

    def __init__(
        self,
        checkpoint_upload_mode: CheckpointUploadMode | str | None = None,
        validation: bool | ValidationTaskConfig = False,
    ) -> None:
        super().__init__()
        if not isinstance(validation, (bool, ValidationTaskConfig)):
            raise ValueError(
                f"RayTrainReportCallback(validation={validation!r}): use True, False or a "
                "lockstep.ValidationTaskConfig."
            )
        self.checkpoint_upload_mode = CheckpointUploadMode(checkpoint_upload_mode or CheckpointUploadMode.SYNC)
        self.validation = validation

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Save the trainer's checkpoint to a local folder and report it with the epoch's metrics."""
        metrics = epoch_metrics(trainer)
        folder = tempfile.mkdtemp(prefix=f"lockstep-lightning-epoch{trainer.current_epoch}-")
        try:
            trainer.save_checkpoint(os.path.join(folder, self.CHECKPOINT_NAME), weights_only=False)
            checkpoint = Checkpoint.from_directory(folder)
            report(
                metrics,
                checkpoint=checkpoint,
                checkpoint_upload_mode=self.checkpoint_upload_mode,
                validation=self.validation,
            )
            trainer.strategy.barrier()
        finally:
            if self.checkpoint_upload_mode is not CheckpointUploadMode.NO_UPLOAD:
                shutil.rmtree(folder, ignore_errors=True)


def epoch_metrics(trainer: Any) -> dict[str, Any]:
    """``trainer.callback_metrics`` as plain numbers, with ``epoch`` and ``step``."""
    metrics = {name: _plain(value) for name, value in trainer.callback_metrics.items()}
    metrics["epoch"] = trainer.current_epoch
    metrics["step"] = trainer.global_step
    return metrics


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
