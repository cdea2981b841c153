"""Run configuration: how many workers, where results go, how failures and checkpoints are handled.

Each class mirrors the Ray Train class of the same name (``ray.train.ScalingConfig`` and
friends) and validates itself on construction, raising ``ValueError`` that names the field.

Example:
    >>> from lockstep import ScalingConfig, RunConfig
    >>> scaling = ScalingConfig(num_workers=2)
    >>> run = RunConfig(name="mnist", storage_path="/tmp/lockstep_results")
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lockstep._internal import config_checks
from lockstep._internal.output.worker_output import CONSOLE_MODES, ConsoleMode
from lockstep._internal.ray_compat.ray_only_configs import LoggingConfig, SyncConfig

PLACEMENT_STRATEGIES = config_checks.PLACEMENT_STRATEGIES
EXECUTORS = config_checks.EXECUTORS
DEFAULT_STORAGE_PATH = "~/lockstep_results"


@dataclass
class ScalingConfig:
    """How many workers to run and what each one gets.

    Args:
        num_workers: Number of worker processes (the world size); or ``(min, max)`` for an
            elastic run, which starts with as many workers as the resources allow (at most
            ``max``, at least ``min``), goes on with fewer (from the latest checkpoint) when
            workers are lost, and grows back, at a checkpoint, when resources return. ``0`` is
            local mode, as in Ray Train 2.x: the train function runs in the process that calls
            ``fit()`` (world size 1, no process group; a debugger works), with the same
            ``report()``, checkpoint and ``Result`` semantics.
        use_gpu: Give each worker one GPU (unless ``resources_per_worker`` says otherwise).
        resources_per_worker: Resources per worker, e.g. ``{"CPU": 2, "GPU": 1}``. Keys are
            case-sensitive. ``CPU`` also sets each worker's torch intra-op thread count.
        trainer_resources: Accepted for compatibility with Ray Train and not used: lockstep's
            coordinator is the process that calls ``fit()``, not an actor of its own.
        placement_strategy: One of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD (Ray executor).
        accelerator_type: Required accelerator type, e.g. ``"A100"`` (Ray executor).
        executor: Where workers run (a lockstep addition): ``"auto"`` (the default) runs the
            train function in this process when torchrun started it (as its rank), else uses
            Ray when ``ray.init()`` was called in this process or ``ray_address`` is set, else
            starts worker processes on this machine; ``"local"`` always starts them on this
            machine; ``"ray"`` always uses Ray (``ray.init()`` is called when needed, which
            honours ``RAY_ADDRESS``).
        ray_address: The Ray cluster to connect to, e.g. ``"auto"`` or ``"10.0.0.5:6379"``
            (a lockstep addition; implies ``executor="ray"``).
        placement_timeout_s: How long the Ray executor waits for the cluster to place the
            workers before ``fit()`` fails (a lockstep addition). A request that the cluster's
            nodes can never hold fails at once.
        label_selector: Ray Train's node-label placement. Not supported (a ValueError says what
            to use instead: a custom resource in ``resources_per_worker``); only None is accepted.
        use_tpu: Ray Train's TPU mode. lockstep runs torch.distributed on CPUs or CUDA GPUs, so
            only False is accepted.
        topology: Ray Train's TPU slice topology; only None is accepted (see ``use_tpu``).
    """

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    trainer_resources: dict[str, float] | None = None
    placement_strategy: str = "PACK"
    accelerator_type: str | None = None
    executor: str = "auto"
    ray_address: str | None = None
    placement_timeout_s: float = 60.0
    label_selector: dict[str, str] | list[dict[str, str]] | None = None
    use_tpu: bool = False
    topology: str | None = None

    def __post_init__(self) -> None:
        config_checks.check_num_workers(self.num_workers)
        config_checks.check_ray_only_placement(self.label_selector, self.use_tpu, self.topology)
        if not isinstance(self.use_gpu, bool):
            raise ValueError(f"ScalingConfig.use_gpu must be True or False, got {self.use_gpu!r}.")
        config_checks.check_resources("resources_per_worker", self.resources_per_worker)
        config_checks.check_resources("trainer_resources", self.trainer_resources)
        config_checks.check_placement(self)
        config_checks.check_executor_fields(self)

    @property
    def wants_ray(self) -> bool:
        """Whether this config asks for the Ray executor whatever the driver's state."""
        return self.executor == "ray" or self.ray_address is not None

    @property
    def min_workers(self) -> int:
        """The fewest workers the run may go on with (``num_workers`` unless it is elastic)."""
        return int(self.num_workers[0]) if isinstance(self.num_workers, (tuple, list)) else int(self.num_workers)

    @property
    def max_workers(self) -> int:
        """The most workers the run uses (``num_workers`` unless it is elastic)."""
        return int(self.num_workers[1]) if isinstance(self.num_workers, (tuple, list)) else int(self.num_workers)

    @property
    def elastic(self) -> bool:
        """Whether the number of workers follows the resources, between min and max."""
        return self.min_workers != self.max_workers

    @property
    def worker_resources(self) -> dict[str, float]:
        """Resources of one worker, as Ray Train fills them in: ``resources_per_worker`` (its
        non-zero amounts), else 1 CPU, or with ``use_gpu`` 1 GPU and no CPU (nodes have many more
        CPUs than GPUs); with ``use_gpu`` 1 GPU unless it names another amount."""
        if self.resources_per_worker is None:
            resources: dict[str, float] = {"GPU": 1.0} if self.use_gpu else {"CPU": 1.0}
        else:
            resources = {key: amount for key, amount in self.resources_per_worker.items() if amount != 0}
        if self.use_gpu:
            resources.setdefault("GPU", 1.0)
        return resources

    @property
    def num_cpus_per_worker(self) -> float:
        """CPUs per worker (default 1)."""
        return float(self.worker_resources.get("CPU", 1.0))

    @property
    def num_gpus_per_worker(self) -> float:
        """GPUs per worker (0 without use_gpu)."""
        return float(self.worker_resources.get("GPU", 0.0)) if self.use_gpu else 0.0


#: How long a run goes on after a preemption notice to reach its next checkpoint (fits
#: Kubernetes' default 30 s grace period).
DEFAULT_PREEMPTION_GRACE_S = 25.0
#: The hang detector's defaults (see ``FailureConfig``): a hang is named after max(60 s, 10 x the
#: median recent step time) without progress, or 600 s before the first step.
DEFAULT_HANG_TIMEOUT_S = 60.0
DEFAULT_HANG_STEP_MULTIPLE = 10.0
DEFAULT_HANG_FIRST_STEP_TIMEOUT_S = 600.0


@dataclass
class FailureConfig:
    """What to do when a worker fails.

    Args:
        max_failures: How many times to restart the worker group from the latest checkpoint
            before ``fit()`` gives up; ``-1`` means without limit.
        report_timeout_s: How long ranks may wait in ``report()`` for a rank that hasn't called
            it yet before that rank is failed (a lockstep addition; None waits forever).
        fail_fast: Ray Train V1's (Tune's) "stop at the first failure". For one run that is
            ``max_failures=0``, so ``fail_fast=True`` (or ``"raise"``) is accepted with
            ``max_failures=0`` and refused with a ValueError otherwise.
        preemption_grace_s: After a preemption notice (SIGTERM to the driver or to a rank),
            how long training may go on to reach its next committed checkpoint before the run
            stops anyway (status ``preempted``). The default, 25 s, fits inside Kubernetes'
            default 30 s termination grace period with time to stop; raise it together with the
            platform's own (``terminationGracePeriodSeconds``, Slurm's ``--signal``).
        max_preemption_failures: Ray Train's budget of preemption restarts. Accepted for
            compatibility: in lockstep a preemption ends ``fit()`` with a PreemptionError (the
            machine is going away); running the same command again continues the run, and a
            preemption never counts against ``max_failures``.
        hang_timeout_s: The hang detector (a lockstep addition, see the Failures guide): once
            the run has completed training steps, when no rank has made progress (no training
            step, no report, no collective) for max(``hang_timeout_s``, ``hang_step_multiple``
            x the median recent step time), the ranks that stopped are named, with where every
            rank is, and the attempt fails as any failure does (restarting per ``max_failures``).
            ``None`` turns the detector off. Default 60 s.
        hang_step_multiple: How many median step times of no progress make a hang, when that
            is longer than ``hang_timeout_s``. Default 10.
        hang_first_step_timeout_s: The same before the first training step of an attempt has
            completed (start-up, compilation and warm-up take unknown time). ``None``: no hang
            is named before the first step. Default 600 s.
    """

    max_failures: int = 0
    report_timeout_s: float | None = 1800.0
    fail_fast: bool | str = False
    preemption_grace_s: float = DEFAULT_PREEMPTION_GRACE_S
    max_preemption_failures: int = -1
    hang_timeout_s: float | None = DEFAULT_HANG_TIMEOUT_S
    hang_step_multiple: float = DEFAULT_HANG_STEP_MULTIPLE
    hang_first_step_timeout_s: float | None = DEFAULT_HANG_FIRST_STEP_TIMEOUT_S

    def __post_init__(self) -> None:
        config_checks.check_failure_config(self)


@dataclass
class CheckpointConfig:
    """Which checkpoints to keep.

    Args:
        num_to_keep: Keep at most this many checkpoints (all when None). The latest is never deleted.
        checkpoint_score_attribute: A reported metric to rank checkpoints by; without it, the
            most recent ones are kept.
        checkpoint_score_order: ``"max"`` or ``"min"``: which end of the metric is best.
        checkpoint_frequency: Ray Train V1's field; only ``0`` (off) is accepted: the train
            function decides when to checkpoint, by passing one to ``report()``.
        checkpoint_at_end: Ray Train V1's field; only ``None``/``False`` are accepted: report a
            checkpoint at the end of the train function instead.
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: Literal["max", "min"] = "max"
    checkpoint_frequency: int = 0
    checkpoint_at_end: bool | None = None

    def __post_init__(self) -> None:
        config_checks.check_checkpoint_config(self)


@dataclass
class RunConfig:
    """Where a run's results go and how it behaves.

    Args:
        name: The run's name: its folder under ``storage_path``. Default:
            ``<TrainerClass>_<timestamp>``. Running again with the same name continues the run.
        storage_path: A local or shared path, or a URI such as ``s3://bucket/prefix``.
            Default ``~/lockstep_results``.
        storage_filesystem: An fsspec filesystem to use with ``storage_path``.
        failure_config: Restart policy, see :class:`FailureConfig`.
        checkpoint_config: Retention policy, see :class:`CheckpointConfig`.
        callbacks: :class:`lockstep.callbacks.Callback` objects the driver calls as the run goes on
            (e.g. ``CSVLogger()``, ``TensorBoardLogger()``, ``MLflowLogger(...)``).
        verbose: ``0`` hides lockstep's progress line; any other value (the default, None)
            shows it: updated in place on a terminal, a plain line at most every 30 s otherwise.
        worker_output: Which workers' printed output the console shows: ``"rank0"`` (default),
            ``"all"`` (each line prefixed with its rank) or ``"none"``. Every rank's output also
            goes to ``<run folder>/logs/rank_<r>.log`` (a lockstep addition).
        logging_config: The level of lockstep's log messages, see :class:`LoggingConfig`.
        local_dir: Ray Train V1's name of ``storage_path`` (works, with a DeprecationWarning).
        log_to_file: Ray Train V1's field: ``True``/``False`` are accepted (each rank's output
            always goes to ``<run folder>/logs/rank_<r>.log``); file names are refused.
        stop: Stop the run early, as Ray Tune's ``stop``: a dict of metric -> threshold (the run
            stops once a reported value is ``>=`` its threshold; ``training_iteration`` is the
            number of reports so far, nested metrics are named ``"outer/inner"``), or a
            function ``(report_index, metrics) -> bool``. Every rank leaves its train function
            from that report's ``report()``, the checkpoints reported so far are committed, the
            run is recorded as ``stopped`` and ``fit()`` returns the Result. Callbacks can stop
            a run too (``run.request_stop(...)``, :class:`lockstep.callbacks.EarlyStopping`).
        metrics_port: Serve the run's Prometheus metrics over HTTP on this port while it runs
            (``0``: a free port; the URL is logged and kept in the run record as
            ``metrics_url``). ``None`` (the default) reads ``LOCKSTEP_METRICS_PORT``, and
            leaves the metrics off when that is unset. Needs ``pip install 'lockstep[metrics]'``
            (a lockstep addition; see the Dashboard and metrics page of the docs).
        storage_retry_s: How long, in seconds, a storage operation (writing or reading checkpoint
            files, the run record or the report history) is retried while it fails with
            transient errors: connections refused or reset, timeouts, DNS failures, throttling
            (``SlowDown``) and 5xx answers of an object store. Retries back off exponentially, with
            jitter; one warning is logged when an outage begins and one when it ends, and
            ``lockstep show`` prints the time lost. Permanent errors (no such bucket, access
            denied, not found) fail at once, and a full disk raises
            :class:`lockstep.StorageFullError`. Default 300 (five minutes); 0 never retries (a
            lockstep addition; see the Checkpoints page of the docs).
        sync_config, progress_reporter, worker_runtime_env: Ray fields without an equivalent
            here; only None (or an empty ``worker_runtime_env``) is accepted, anything else
            raises a ValueError that says what to use.
    """

    name: str | None = None
    storage_path: str | os.PathLike[str] | None = None
    storage_filesystem: Any = None
    failure_config: FailureConfig = field(default_factory=FailureConfig)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    callbacks: list[Any] = field(default_factory=list)
    verbose: int | None = None
    worker_output: ConsoleMode = "rank0"
    logging_config: LoggingConfig | None = None
    local_dir: str | os.PathLike[str] | None = None
    log_to_file: bool | None = None
    stop: Mapping[str, float] | Callable[[int, dict[str, Any]], bool] | None = None
    sync_config: Any = None
    progress_reporter: Any = None
    worker_runtime_env: dict[str, Any] | None = None
    metrics_port: int | None = None
    storage_retry_s: float = 300.0

    def __post_init__(self) -> None:
        config_checks.check_metrics_port(self.metrics_port, "RunConfig.metrics_port")
        config_checks.check_storage_retry_s(self.storage_retry_s)
        config_checks.check_v1_run_fields(
            stop=self.stop,
            log_to_file=self.log_to_file,
            sync_config=self.sync_config,
            progress_reporter=self.progress_reporter,
            worker_runtime_env=self.worker_runtime_env,
        )
        self.storage_path = config_checks.storage_path_from_local_dir(self.storage_path, self.local_dir)
        if self.logging_config is not None:
            if not isinstance(self.logging_config, LoggingConfig):
                raise ValueError(f"RunConfig.logging_config must be a LoggingConfig, got {self.logging_config!r}.")
            self.logging_config.apply()
        config_checks.check_run_name(self.name)
        if self.storage_path is not None:
            self.storage_path = os.fspath(self.storage_path)
        if self.failure_config is None:
            self.failure_config = FailureConfig()
        if self.checkpoint_config is None:
            self.checkpoint_config = CheckpointConfig()
        if not isinstance(self.failure_config, FailureConfig):
            raise ValueError(f"RunConfig.failure_config must be a FailureConfig, got {self.failure_config!r}.")
        if not isinstance(self.checkpoint_config, CheckpointConfig):
            raise ValueError(f"RunConfig.checkpoint_config must be a CheckpointConfig, got {self.checkpoint_config!r}.")
        from lockstep.callbacks import check_callbacks

        self.callbacks = list(self.callbacks or [])
        check_callbacks(self.callbacks)
        if self.worker_output not in CONSOLE_MODES:
            raise ValueError(
                f"RunConfig.worker_output must be one of {', '.join(CONSOLE_MODES)}, got {self.worker_output!r}."
            )


@dataclass
class DataConfig:
    """How ``datasets=`` are split across workers.

    Args:
        datasets_to_split: ``"all"`` or the names of the datasets to shard; the others are
            given whole to every worker.
    """

    datasets_to_split: Literal["all"] | list[str] = "all"

    def __post_init__(self) -> None:
        valid = self.datasets_to_split == "all" or (
            isinstance(self.datasets_to_split, (list, tuple))
            and all(isinstance(n, str) for n in self.datasets_to_split)
        )
        if not valid:
            raise ValueError(
                "DataConfig.datasets_to_split must be 'all' or a list of dataset names, "
                f"got {self.datasets_to_split!r}."
            )

    def should_split(self, name: str) -> bool:
        """Whether dataset ``name`` is sharded across workers."""
        return self.datasets_to_split == "all" or name in self.datasets_to_split


__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "FailureConfig",
    "LoggingConfig",
    "RunConfig",
    "ScalingConfig",
    "SyncConfig",
]
