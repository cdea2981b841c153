"""DataParallelTrainer: checks the user's job, then hands it to the controller and an executor."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from lockstep._internal.executors import choose_executor, is_ray_dataset
from lockstep._internal.payload import TrainJob
from lockstep._internal.persist.storage import RunStorage, storage_errors
from lockstep._internal.run.config_record import config_record
from lockstep._internal.run.driver import RunDriver
from lockstep._internal.run.run_names import default_run_name
from lockstep._internal.run.validation import ValidationSetup
from lockstep.backend import BackendConfig
from lockstep.callbacks import TrainRunContext, UserCallback
from lockstep.checkpoint import Checkpoint
from lockstep.config import DEFAULT_STORAGE_PATH, DataConfig, RunConfig, ScalingConfig
from lockstep.result import Result
from lockstep.validation import ValidationConfig

__all__ = ["DataParallelTrainer", "check_type", "default_run_name"]

logger = logging.getLogger(__name__)


class DataParallelTrainer:
    """Runs ``train_loop_per_worker`` on ``scaling_config.num_workers`` workers.

    Args:
        train_loop_per_worker: The train function: no argument, or one (the config dict).
        train_loop_config: The dict passed to the train function.
        backend_config: Worker set-up around the train function (e.g. TorchConfig).
        scaling_config: Number of workers and their resources.
        run_config: Name, storage, failure and checkpoint policies.
        datasets: Named datasets, split into one shard per worker (see
            :func:`lockstep.get_dataset_shard`): map-style torch datasets, or ``ray.data.Dataset``
            objects with the Ray executor (each rank gets an equal streaming split).
        dataset_config: Which datasets to split.
        metadata: A JSON-serializable dict every worker sees in ``get_context().get_metadata()``.
        resume_from_checkpoint: A checkpoint ``get_checkpoint()`` returns at the start, unless
            the run already has a newer one of its own.
        validation_config: The function that validates checkpoints reported with
            ``report(..., validation=...)``, see :mod:`lockstep.validation`.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        backend_config: BackendConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        validation_config: ValidationConfig | None = None,
    ) -> None:
        _check_train_fn(train_loop_per_worker)
        check_type("train_loop_config", train_loop_config, Mapping, "a dict")
        check_type("scaling_config", scaling_config, ScalingConfig, "a ScalingConfig")
        check_type("run_config", run_config, RunConfig, "a RunConfig")
        check_type("datasets", datasets, Mapping, "a dict of name -> dataset")
        check_type("dataset_config", dataset_config, DataConfig, "a DataConfig")
        check_type("metadata", metadata, Mapping, "a dict")
        check_type("resume_from_checkpoint", resume_from_checkpoint, Checkpoint, "a lockstep.Checkpoint")
        check_type("validation_config", validation_config, ValidationConfig, "a lockstep.ValidationConfig")
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config) if train_loop_config is not None else None
        self.backend_config = backend_config or BackendConfig()
        self.scaling_config = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.datasets = dict(datasets or {})
        self._ray_datasets = {name: dataset for name, dataset in self.datasets.items() if is_ray_dataset(dataset)}
        self._torch_datasets = {
            name: dataset for name, dataset in self.datasets.items() if name not in self._ray_datasets
        }
        self.dataset_config = dataset_config or DataConfig()
        self.metadata = dict(metadata or {})
        self.resume_from_checkpoint = resume_from_checkpoint
        self.validation_config = validation_config
        _check_datasets(self._torch_datasets, self.dataset_config, max(1, self.scaling_config.max_workers))

    def fit(self) -> Result:
        """Run the train function on every worker and wait for the run to end.

        Returns:
            The run's :class:`Result`.

        Raises:
            TrainingFailedError: a worker failed (more often than ``max_failures`` allows).
            ValueError, TypeError: the job can't start (bad input, unpicklable objects); raised
                before any worker starts.
        """
        executor = choose_executor(self.scaling_config, self._ray_datasets, self.dataset_config.should_split)
        storage = self._run_storage(executor.run_name(self.run_config.name, type(self).__name__))
        scaling = executor.run_scaling(self.scaling_config)
        driver = RunDriver(
            storage,
            self.run_config,
            scaling,
            has_resume_checkpoint=self.resume_from_checkpoint is not None,
            config=self._config_record(scaling),
            run_context=self._run_context(),
        )
        if self.validation_config is not None:
            launcher = executor.validation_launcher(self.validation_config, driver.log_dir)
            driver.validation = ValidationSetup(self.validation_config, launcher)
        try:
            with executor.reserve(storage.name):
                return executor.launch(self._job(storage), driver)
        finally:
            driver.discard_unused_logs()

    def _config_record(self, scaling: ScalingConfig) -> dict[str, Any]:
        """The run's configuration as its record keeps it."""
        configs = {"scaling_config": scaling, "run_config": self.run_config, "backend_config": self.backend_config}
        return config_record(self.train_loop_config, configs, self.datasets)

    def _run_context(self) -> TrainRunContext:
        """What Ray's UserCallbacks get as ``run_context``."""
        return TrainRunContext(
            run_config=self.run_config,
            train_loop_config=self.train_loop_config,
            scaling_config=self.scaling_config,
            backend_config=self.backend_config,
            dataset_config=self.dataset_config,
        )

    def _run_storage(self, name: str) -> RunStorage:
        storage_path = os.fspath(self.run_config.storage_path or DEFAULT_STORAGE_PATH)
        with storage_errors(storage_path):
            return RunStorage.for_run(
                storage_path, name, self.run_config.storage_filesystem, self.run_config.storage_retry_s
            )

    def _job(self, storage: RunStorage) -> TrainJob:
        """What every rank runs."""
        return TrainJob(
            train_fn=self.train_loop_per_worker,
            train_loop_config=self.train_loop_config,
            backend_config=self.backend_config,
            use_gpu=self.scaling_config.use_gpu,
            storage=storage,
            resume_checkpoint=self.resume_from_checkpoint,
            datasets=self._torch_datasets,
            dataset_config=self.dataset_config,
            metadata=self.metadata,
            has_validation=self.validation_config is not None,
            every_rank_metrics=any(isinstance(callback, UserCallback) for callback in self.run_config.callbacks),
        )


def _check_train_fn(train_fn: Any) -> None:
    if not callable(train_fn):
        raise TypeError(f"train_loop_per_worker must be a function, got {type(train_fn).__name__}.")
    try:
        parameters = inspect.signature(train_fn).parameters.values()
    except (TypeError, ValueError):
        return
    required = [
        parameter.name
        for parameter in parameters
        if parameter.default is inspect.Parameter.empty
        and parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) > 1:
        raise ValueError(
            f"train_loop_per_worker {getattr(train_fn, '__name__', train_fn)!r} requires {len(required)} arguments "
            f"({', '.join(required)}); it must take none, or one: the train_loop_config dict."
        )


def _check_datasets(datasets: dict[str, Any], config: DataConfig, num_workers: int) -> None:
    """Datasets to split must be map-style and hold at least one item per worker."""
    for name, dataset in datasets.items():
        if not config.should_split(name):
            continue
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(
                f"datasets[{name!r}] is a {type(dataset).__name__}; only map-style datasets (with __len__ and "
                "__getitem__) can be split across workers. Build a DataLoader inside the train function instead, "
                "or leave it out of DataConfig.datasets_to_split."
            )
        if len(dataset) < num_workers:
            raise ValueError(
                f"datasets[{name!r}] has {len(dataset)} items, fewer than num_workers={num_workers}: "
                "some workers would get nothing. Use fewer workers or more data."
            )
        if len(dataset) % num_workers:
            logger.info(
                "datasets[%r]: the last %d items are left out so every worker gets %d.",
                name,
                len(dataset) % num_workers,
                len(dataset) // num_workers,
            )


def check_type(name: str, value: Any, expected: type, description: str) -> None:
    """Raise ValueError unless ``value`` is None or an ``expected``."""
    if value is not None and not isinstance(value, expected):
        raise ValueError(f"{name} must be {description}, got {type(value).__name__}.")
