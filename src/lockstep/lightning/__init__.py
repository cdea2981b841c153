"""PyTorch Lightning in a lockstep train function, with Ray Train's ``ray.train.lightning`` names.

A Ray Train Lightning script moves over by changing imports::

    from lockstep.lightning import (        # was: from ray.train.lightning import (
        RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer)

    def train_func():
        model = MyLightningModule()
        trainer = pl.Trainer(
            devices="auto", accelerator="auto",
            strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
            callbacks=[RayTrainReportCallback()], enable_checkpointing=False)
        trainer = prepare_trainer(trainer)
        trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader)

Both Lightning packages work: ``import lightning.pytorch as pl`` and ``import pytorch_lightning
as pl``. The classes here are built for the package that the code creating them uses (its
``pl`` module, ``Trainer`` or ``LightningModule``; else the one imported; set
``LOCKSTEP_LIGHTNING_PACKAGE`` to decide). Importing this module imports neither package.
"""

from __future__ import annotations

from typing import Any

from lockstep.lightning._binding import PackageBound
from lockstep.lightning._package import installed_packages

if not installed_packages():
    raise ModuleNotFoundError(
        "lockstep.lightning needs PyTorch Lightning: pip install lightning (or pytorch-lightning)."
    )

__all__ = [
    "RayDDPStrategy",
    "RayDeepSpeedStrategy",
    "RayFSDPStrategy",
    "RayLightningEnvironment",
    "RayTrainReportCallback",
    "prepare_trainer",
]


class RayDDPStrategy(metaclass=PackageBound):
    """Lightning's ``DDPStrategy`` on lockstep's process group and the worker's device.

    Takes ``DDPStrategy``'s arguments (``find_unused_parameters=True``, ``static_graph=True``, …).
    The process group's backend and timeout are ``TorchConfig``'s, so ``process_group_backend``,
    ``timeout`` and ``start_method`` are ignored here. Distributed samplers get one replica per
    lockstep worker.
    """

    _lockstep_role = "ddp"


class RayFSDPStrategy(metaclass=PackageBound):
    """Lightning's ``FSDPStrategy`` (fully sharded data parallel) on lockstep's process group.

    Takes ``FSDPStrategy``'s arguments (``sharding_strategy``, ``auto_wrap_policy``,
    ``state_dict_type``, …); as with :class:`RayDDPStrategy`, the process group is ``TorchConfig``'s.
    """

    _lockstep_role = "fsdp"


class RayDeepSpeedStrategy(metaclass=PackageBound):
    """Lightning's ``DeepSpeedStrategy`` on lockstep's process group.

    Raises ``ImportError`` on creation when the ``deepspeed`` package is not installed.
    """

    _lockstep_role = "deepspeed"


class RayLightningEnvironment(metaclass=PackageBound):
    """Lightning's cluster environment for a lockstep worker: world size, global, local and node
    rank come from :func:`lockstep.get_context`, and Lightning starts no processes of its own."""

    _lockstep_role = "environment"


class RayTrainReportCallback(metaclass=PackageBound):
    """A Lightning callback that calls :func:`lockstep.report` at the end of every train epoch.

    The metrics are ``trainer.callback_metrics`` (validation metrics included, as plain numbers)
    plus ``epoch`` and ``step``; the checkpoint folder holds the trainer's checkpoint as
    ``checkpoint.ckpt`` (:attr:`CHECKPOINT_NAME`)::

        checkpoint_000001/
            checkpoint.ckpt

    Reload the model with ``MyModule.load_from_checkpoint(os.path.join(path, "checkpoint.ckpt"))``.

    Args:
        checkpoint_upload_mode: How ``report()`` stores the checkpoint (default SYNC), see
            :class:`lockstep.CheckpointUploadMode`.
        validation: Validate each epoch's checkpoint with the trainer's ``validation_config``
            (True, or a :class:`lockstep.ValidationTaskConfig`), as ``report(validation=...)``
            does; see :mod:`lockstep.validation`.
    """

    _lockstep_role = "report_callback"
    CHECKPOINT_NAME = "checkpoint.ckpt"


_STRATEGIES = (RayDDPStrategy, RayFSDPStrategy, RayDeepSpeedStrategy)


def prepare_trainer(trainer: Any) -> Any:
    """Check that a Lightning ``Trainer`` is set up to run on lockstep's workers; return it.

    Raises:
        ValueError: the trainer's strategy is not one of lockstep's strategies, or its cluster
            environment is not :class:`RayLightningEnvironment`.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, _STRATEGIES):
        names = ", ".join(cls.__name__ for cls in _STRATEGIES)
        raise ValueError(
            f"prepare_trainer: the Trainer's strategy is {type(strategy).__name__}; pass one of {names} "
            "(from lockstep.lightning), e.g. pl.Trainer(strategy=RayDDPStrategy(), ...)."
        )
    environment = getattr(strategy, "cluster_environment", None)
    if environment is not None and not isinstance(environment, RayLightningEnvironment):
        raise ValueError(
            f"prepare_trainer: the Trainer's cluster environment is {type(environment).__name__}; pass "
            "plugins=[RayLightningEnvironment()] (from lockstep.lightning) to pl.Trainer."
        )
    return trainer
