"""DataParallelTrainer: checks the user's job, then hands it to the controller and an executor."""

from __future__ import annotations

import inspect
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, Callable

from lockstep._internal import progress
from lockstep._internal.controller import Controller
from lockstep._internal.executors import GroupFactory, external, make_group_factory
from lockstep._internal.executors.ray import is_ray_dataset
from lockstep._internal.payload import WorkerPayload, serialize_payload
from lockstep._internal.run_record import RunRecorder
from lockstep._internal.storage import RunStorage, check_storage_path, storage_errors
from lockstep.backend import BackendConfig
from lockstep.callbacks import CallbackRunner, RunInfo
from lockstep.checkpoint import Checkpoint
from lockstep.config import DEFAULT_STORAGE_PATH, DataConfig, RunConfig, ScalingConfig
from lockstep.result import Result

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
    ) -> None:
        _check_train_fn(train_loop_per_worker)
        check_type("train_loop_config", train_loop_config, Mapping, "a dict")
        check_type("scaling_config", scaling_config, ScalingConfig, "a ScalingConfig")
        check_type("run_config", run_config, RunConfig, "a RunConfig")
        check_type("datasets", datasets, Mapping, "a dict of name -> dataset")
        check_type("dataset_config", dataset_config, DataConfig, "a DataConfig")
        check_type("metadata", metadata, Mapping, "a dict")
        check_type("resume_from_checkpoint", resume_from_checkpoint, Checkpoint, "a lockstep.Checkpoint")
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config) if train_loop_config is not None else None
        self.backend_config = backend_config or BackendConfig()
        self.scaling_config = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.datasets = dict(datasets or {})
        self._ray_datasets = {name: dataset for name, dataset in self.datasets.items() if is_ray_dataset(dataset)}
        self._torch_datasets = {name: dataset for name, dataset in self.datasets.items() if name not in self._ray_datasets}
        self.dataset_config = dataset_config or DataConfig()
        self.metadata = dict(metadata or {})
        self.resume_from_checkpoint = resume_from_checkpoint
        _check_datasets(self._torch_datasets, self.dataset_config, self.scaling_config.max_workers)

    def fit(self) -> Result:
        """Run the train function on every worker and wait for the run to end.

        Returns:
            The run's :class:`Result`.

        Raises:
            TrainingFailedError: a worker failed (more often than ``max_failures`` allows).
            ValueError, TypeError: the job can't start (bad input, unpicklable objects); raised
                before any worker starts.
        """
        launch = external.launched_externally() if self.scaling_config.executor == "auto" else None
        if launch is not None:
            return self._fit_in_launched_processes(launch)
        name = self.run_config.name or default_run_name(type(self).__name__)
        storage = self._run_storage(name)
        log_dir = storage.local_log_dir()
        make_group = make_group_factory(
            self.scaling_config, log_dir, self.run_config.worker_output, self._ray_datasets, self.dataset_config.should_split
        )
        return self._drive(storage, log_dir, make_group, self.run_config.failure_config.max_failures,
                           lambda controller, payload: controller.run(payload))

    def _run_storage(self, name: str) -> RunStorage:
        storage_path = self.run_config.storage_path or DEFAULT_STORAGE_PATH
        with storage_errors(storage_path):
            return RunStorage.for_run(storage_path, name, self.run_config.storage_filesystem)

    def _drive(
        self, storage: RunStorage, log_dir: str, make_group: GroupFactory, max_failures: int,
        run: Callable[[Controller, bytes], Result],
    ) -> Result:
        """Open the run record, build the payload and the controller, and ``run`` them."""
        scaling, storage_path = self.scaling_config, self.run_config.storage_path or DEFAULT_STORAGE_PATH
        with storage_errors(storage_path):
            check_storage_path(storage_path, storage)
            recorder = RunRecorder(storage, self.run_config.checkpoint_config, scaling.max_workers, make_group.executor)
            recorder.check_resumable()
        build_payload = self._payload_builder(storage, recorder)
        first_payload = build_payload(recorder.next_report_index, recorder.latest_checkpoint or self.resume_from_checkpoint)
        with storage_errors(storage_path):
            recorder.open()
        logger.info("Run %s: %s workers (%s executor), results in %s", storage.name, scaling.num_workers,
                    make_group.executor, storage.display_path)
        progress_line = progress.ProgressLine(storage.name, scaling.max_workers) if self.run_config.verbose != 0 else None
        run_info = RunInfo(storage.name, storage.display_path, scaling.max_workers, log_dir)
        controller = Controller(
            make_group, build_payload, recorder, max_failures, self.resume_from_checkpoint,
            self.run_config.failure_config.report_timeout_s, progress_line,
            CallbackRunner(self.run_config.callbacks, run_info),
        )
        try:
            with progress.showing(progress_line):
                return run(controller, first_payload)
        finally:
            storage.upload_logs(log_dir)

    def _fit_in_launched_processes(self, launch: external.Launch) -> Result:
        """Under torchrun: run the train function in this process as its rank; rank 0 also
        drives the run (see :mod:`lockstep._internal.executors.external`)."""
        external.check_world_size(launch, self.scaling_config)
        if self._ray_datasets:
            raise ValueError("Ray Datasets need the Ray executor; under torchrun pass torch datasets.")
        store = external.rendezvous_store(launch)
        name = self.run_config.name or external.shared_run_name(launch, store, type(self).__name__)
        storage = self._run_storage(name)
        if launch.rank != 0:
            external.run_rank_or_raise(launch, store, self.scaling_config.use_gpu)
            external.await_end(launch, store)
            return Result.from_path(storage.display_path, self.run_config.storage_filesystem)
        group = external.ExternalGroup(launch.world_size)
        make_group = GroupFactory("external", lambda size: group, launch.world_size, launch.world_size)
        log_dir = storage.local_log_dir()
        return self._drive(storage, log_dir, make_group, 0,
                           lambda controller, payload: external.drive_and_run_rank_0(launch, store, group, controller, payload,
                                                                                   self.scaling_config.use_gpu))

    def _payload_builder(self, storage: RunStorage, recorder: RunRecorder) -> Callable[[int, Checkpoint | None], bytes]:
        def build(first_report_index: int, checkpoint: Checkpoint | None) -> bytes:
            return serialize_payload(
                WorkerPayload(
                    train_fn=self.train_loop_per_worker,
                    train_loop_config=self.train_loop_config,
                    backend_config=self.backend_config,
                    use_gpu=self.scaling_config.use_gpu,
                    storage=storage,
                    experiment_name=storage.name,
                    first_report_index=first_report_index,
                    checkpoint=checkpoint,
                    used_dir_names=recorder.committed_dir_names,
                    datasets=self._torch_datasets,
                    dataset_config=self.dataset_config,
                    metadata=self.metadata,
                )
            )

        return build


def default_run_name(trainer_name: str) -> str:
    """``<Trainer>_<date>_<time>_<4 hex>``: sortable, and unique even for runs started in the same second."""
    return f"{trainer_name}_{time.strftime('%Y-%m-%d_%H-%M-%S')}_{uuid.uuid4().hex[:4]}"


def _check_train_fn(train_fn: Any) -> None:
    if not callable(train_fn):
        raise TypeError(f"train_loop_per_worker must be a function, got {type(train_fn).__name__}.")
    try:
        parameters = inspect.signature(train_fn).parameters.values()
    except (TypeError, ValueError):
        return
    required = [
        parameter.name for parameter in parameters
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
            logger.info("datasets[%r]: the last %d items are left out so every worker gets %d.",
                        name, len(dataset) % num_workers, len(dataset) // num_workers)


def check_type(name: str, value: Any, expected: type, description: str) -> None:
    """Raise ValueError unless ``value`` is None or an ``expected``."""
    if value is not None and not isinstance(value, expected):
        raise ValueError(f"{name} must be {description}, got {type(value).__name__}.")

