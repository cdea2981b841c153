"""Executors: how a run's ranks start, and how the run is driven. :func:`choose_executor` is
the one place that picks one for a ``fit()``:

- **external**: this process was started by torchrun (or a launcher that sets the same
  variables); each such process runs the train function as its rank.
- **ray**: Ray actors, when asked for (``executor="ray"``, ``ray_address=``), when the driver
  called ``ray.init()``, or when Ray Datasets are passed.
- **local**: fresh processes on this machine otherwise.
- **local_mode** (``num_workers=0``): the train function runs in this process, the run driven
  from a thread (see :mod:`lockstep._internal.executors.local_mode`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from lockstep._internal.executors.base import Executor
from lockstep._internal.rank.rank_env import launched_by_launcher
from lockstep._internal.run.worker_group import GroupSpec
from lockstep._internal.warm import warm_start
from lockstep.config import ScalingConfig

logger = logging.getLogger(__name__)


def choose_executor(
    scaling: ScalingConfig, ray_datasets: Mapping[str, Any], should_split: Callable[[str], bool] = lambda name: True
) -> Executor:
    """The executor for a ``fit()`` with ``scaling`` and these Ray Datasets, from the config
    and this process's environment. Connects to Ray when the Ray executor is chosen and this
    process is not connected yet.

    Raises:
        ValueError: the request can't be met (a wrong world size under torchrun, Ray Datasets
            without Ray, a request bigger than this machine or the Ray cluster); raised before
            anything starts.
    """
    if scaling.num_workers == 0:
        return _local_mode_executor(scaling, ray_datasets)
    spec = group_spec(scaling)
    if scaling.executor == "auto" and launched_by_launcher():
        from lockstep._internal.executors.external import ExternalExecutor

        return ExternalExecutor.from_environ(scaling, ray_datasets)
    if _wants_ray(scaling, ray_datasets):
        from lockstep._internal.executors import ray as ray_executor
        from lockstep._internal.executors.ray_connect import connect

        connect(scaling.ray_address)
        warm_start.release_unused("this fit runs on Ray")
        if ray_datasets and scaling.executor == "auto" and scaling.ray_address is None:
            logger.info("datasets %s are Ray Datasets: running on Ray (%s).", sorted(ray_datasets), _ray_instance())
        return ray_executor.RayExecutor(scaling, spec, ray_datasets, should_split)
    if ray_datasets:
        raise ValueError(
            f"datasets {sorted(ray_datasets)} are Ray Datasets, which need the Ray executor; "
            "ScalingConfig(executor='local') rules it out: drop executor='local', or pass torch datasets."
        )
    from lockstep._internal.executors.local import LocalExecutor

    return LocalExecutor(scaling, spec)


def _local_mode_executor(scaling: ScalingConfig, ray_datasets: Mapping[str, Any]) -> Executor:
    """``num_workers=0`` (local mode, as in Ray Train): the train function runs in this process.
    Under torchrun, each of its processes is then a rank, whatever the world size (Ray Train
    does the same)."""
    if launched_by_launcher():
        from lockstep._internal.executors.external import ExternalExecutor
        from lockstep._internal.executors.torchrun_store import Launch

        if ray_datasets:
            raise ValueError("Ray Datasets need the Ray executor; under torchrun pass torch datasets.")
        return ExternalExecutor(Launch.from_environ(), scaling.use_gpu)
    from lockstep._internal.executors.local_mode import LocalModeExecutor

    return LocalModeExecutor(scaling, ray_datasets)


def _wants_ray(scaling: ScalingConfig, ray_datasets: Mapping[str, Any]) -> bool:
    if scaling.executor == "local":
        return False
    return scaling.wants_ray or bool(ray_datasets) or ray_is_initialized()


def _ray_instance() -> str:
    """Which Ray this process is connected to, in words: a local instance it started (as
    creating a Ray Dataset does when ``ray.init()`` was not called), or a running cluster."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # private, hence the fallbacks
    if getattr(node, "head", False):
        return "a local Ray instance this process started"
    address = getattr(node, "gcs_address", None)
    return f"connected to the Ray cluster at {address}" if address else "connected to a running Ray cluster"


def ray_is_initialized() -> bool:
    """Whether this process has called ``ray.init()`` (without importing Ray if it hasn't)."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def is_ray_dataset(value: Any) -> bool:
    """Whether ``value`` is a ``ray.data.Dataset`` (checked without importing Ray)."""
    return type(value).__module__.startswith("ray.data") and hasattr(value, "streaming_split")


def group_spec(scaling: ScalingConfig) -> GroupSpec:
    """What ``scaling`` asks of each attempt's group (the executor adds where logs go)."""
    return GroupSpec(
        num_workers=scaling.min_workers,
        cpus_per_worker=scaling.num_cpus_per_worker,
        gpus_per_worker=scaling.num_gpus_per_worker,
        use_gpu=scaling.use_gpu,
        resources_per_worker=scaling.worker_resources,
        placement_strategy=scaling.placement_strategy,
        accelerator_type=scaling.accelerator_type,
        placement_timeout_s=float(scaling.placement_timeout_s),
    )
