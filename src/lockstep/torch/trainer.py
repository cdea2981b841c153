"""TorchTrainer: the data-parallel trainer with a torch.distributed process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lockstep.checkpoint import Checkpoint
from lockstep.config import DataConfig, RunConfig, ScalingConfig
from lockstep.torch.config import TorchConfig
from lockstep.trainer import DataParallelTrainer, check_type
from lockstep.validation import ValidationConfig

__all__ = ["TorchTrainer"]


class TorchTrainer(DataParallelTrainer):
    """Runs a PyTorch train function on several workers joined in one process group.

    Example:
        >>> def train_func(config):                                        # doctest: +SKIP
        ...     model = lockstep.torch.prepare_model(build_model())
        ...     for epoch in range(config["epochs"]):
        ...         loss = train_one_epoch(model)
        ...         lockstep.report({"loss": loss, "epoch": epoch})
        >>> trainer = TorchTrainer(train_func, train_loop_config={"epochs": 2},
        ...                        scaling_config=ScalingConfig(num_workers=2))
        >>> result = trainer.fit()                                         # doctest: +SKIP

    Args:
        train_loop_per_worker: The train function: no argument, or one (the config dict).
        train_loop_config: The dict passed to the train function.
        torch_config: Process group settings (backend, init method, timeout).
        scaling_config: Number of workers and their resources.
        run_config: Name, storage, failure and checkpoint policies.
        datasets: Named map-style datasets, split into one shard per worker.
        dataset_config: Which datasets to split.
        metadata: A dict every worker sees in ``get_context().get_metadata()``.
        resume_from_checkpoint: A checkpoint ``get_checkpoint()`` returns at the start.
        validation_config: The function that validates checkpoints reported with
            ``report(..., validation=...)``, see :mod:`lockstep.validation`.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        torch_config: TorchConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        validation_config: ValidationConfig | None = None,
    ) -> None:
        check_type("torch_config", torch_config, TorchConfig, "a TorchConfig")
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=torch_config or TorchConfig(),
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            metadata=metadata,
            resume_from_checkpoint=resume_from_checkpoint,
            validation_config=validation_config,
        )
