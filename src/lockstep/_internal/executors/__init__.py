"""Executors: who starts the worker processes. Chosen once per ``fit()``."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable

from lockstep._internal.executors.base import GroupSpec, WorkerGroup
from lockstep.config import ScalingConfig
from lockstep.errors import TrainingFailedError

logger = logging.getLogger(__name__)

LOCAL_RESOURCE_KEYS = ("CPU", "GPU", "memory")


@dataclass(frozen=True)
class GroupFactory:
    """Starts one worker group per attempt with the executor named ``executor``: of
    ``max_workers`` workers, or for an elastic run as many as ``capacity()`` (how many workers
    the resources hold now) allows, at least ``min_workers``."""

    executor: str
    start_group: Callable[[int], WorkerGroup]
    min_workers: int
    max_workers: int
    capacity: Callable[[], int] | None = None

    @property
    def elastic(self) -> bool:
        """Whether the group's size follows the resources."""
        return self.min_workers != self.max_workers and self.capacity is not None

    def size_now(self) -> int:
        """The size of the next group.

        Raises:
            TrainingFailedError: an elastic run's resources hold fewer than ``min_workers``.
        """
        if not self.elastic:
            return self.max_workers
        fits = min(self.max_workers, self._capacity())
        if fits < self.min_workers:
            raise TrainingFailedError(
                f"The resources hold {fits} worker(s) now, fewer than the {self.min_workers} that "
                f"ScalingConfig(num_workers=({self.min_workers}, {self.max_workers})) needs at least."
            )
        return fits

    def can_grow(self, current: int) -> bool:
        """Whether an elastic run of ``current`` workers could have more now."""
        return self.elastic and current < self.max_workers and min(self.max_workers, self._capacity()) > current

    def _capacity(self) -> int:
        assert self.capacity is not None
        return self.capacity()

    def __call__(self, size: int) -> WorkerGroup:
        return self.start_group(size)


def make_group_factory(
    scaling: ScalingConfig,
    log_dir: str | None = None,
    console: str = "rank0",
    ray_datasets: Mapping[str, Any] | None = None,
    should_split: Callable[[str], bool] = lambda name: True,
) -> GroupFactory:
    """What starts a fresh worker group for ``scaling`` (one call per attempt), on Ray when
    :func:`uses_ray` says so, else on this machine.

    Raises:
        ValueError: the request can't be met (on this machine, or by the Ray cluster as it is);
            raised before anything starts.
    """
    spec = GroupSpec(
        num_workers=scaling.min_workers,
        cpus_per_worker=scaling.num_cpus_per_worker,
        gpus_per_worker=scaling.num_gpus_per_worker,
        use_gpu=scaling.use_gpu,
        resources_per_worker=scaling.worker_resources,
        log_dir=log_dir,
        console=console,
        placement_strategy=scaling.placement_strategy,
        accelerator_type=scaling.accelerator_type,
        placement_timeout_s=float(scaling.placement_timeout_s),
    )
    if uses_ray(scaling):
        from lockstep._internal.executors import ray as ray_executor

        ray_executor.check_request(spec)
        logger.info("Running %s workers on the Ray cluster.", scaling.num_workers)
        return GroupFactory(
            "ray", lambda size: ray_executor.RayWorkerGroup(replace(spec, num_workers=size), ray_datasets, should_split),
            scaling.min_workers, scaling.max_workers, lambda: ray_executor.cluster_capacity(spec),
        )
    if ray_datasets:
        raise ValueError(
            f"datasets {sorted(ray_datasets)} are Ray Datasets, which need the Ray executor: call ray.init() "
            "before fit(), or pass ScalingConfig(executor='ray')."
        )
    from lockstep._internal.executors.local import LocalWorkerGroup

    check_local_resources(spec if scaling.elastic else replace(spec, num_workers=scaling.max_workers))
    return GroupFactory(
        "local", lambda size: LocalWorkerGroup(replace(spec, num_workers=size)),
        scaling.min_workers, scaling.max_workers, lambda: local_capacity(spec),
    )


def local_capacity(spec: GroupSpec) -> int:
    """How many workers of ``spec`` this machine holds: the CPUs this process may run on (its
    affinity, as ``taskset`` sets it) and, with GPUs, the usable GPUs."""
    fits = int(len(os.sched_getaffinity(0)) // spec.cpus_per_worker) if spec.cpus_per_worker > 0 else 1_000_000
    if spec.use_gpu and spec.gpus_per_worker > 0:
        from lockstep._internal.devices import usable_gpu_ids

        fits = min(fits, int(len(usable_gpu_ids()) // spec.gpus_per_worker))
    return fits


def uses_ray(scaling: ScalingConfig) -> bool:
    """Whether ``fit()`` runs on Ray: asked for in ``scaling``, or ``ray.init()`` was called in
    this process (as Ray Train scripts do) and ``scaling.executor`` is not ``"local"``.
    Connects to Ray when asked for and not connected yet."""
    from lockstep._internal.executors import ray as ray_executor

    if scaling.executor == "local":
        return False
    if scaling.wants_ray:
        ray_executor.connect(scaling.ray_address)
        return True
    if ray_executor.ray_is_initialized():
        ray_executor.connect(None)
        return True
    return False


def check_local_resources(spec: GroupSpec) -> None:
    """Refuse requests this machine can't meet; warn about CPU oversubscription."""
    unknown = sorted(set(spec.resources_per_worker) - set(LOCAL_RESOURCE_KEYS))
    if unknown:
        raise ValueError(
            f"ScalingConfig.resources_per_worker asks for {unknown}, which the local executor doesn't "
            f"provide (it knows {', '.join(LOCAL_RESOURCE_KEYS)}). Custom resources are for Ray "
            "clusters: call ray.init(...) before fit(), or remove them."
        )
    if spec.use_gpu:
        _check_gpus(spec)
    cpus = os.cpu_count() or 1
    _check_fits_one_machine(spec, cpus)
    wanted = spec.num_workers * spec.cpus_per_worker
    if wanted > cpus:
        logger.warning(
            "%d workers x %g CPUs = %g CPUs, but this machine has %d; they will share cores and run slower.",
            spec.num_workers, spec.cpus_per_worker, wanted, cpus,
        )


def _check_fits_one_machine(spec: GroupSpec, cpus: int) -> None:
    """One worker asking for more CPUs or memory than this machine has can never run."""
    if spec.cpus_per_worker > cpus:
        raise ValueError(
            f"resources_per_worker asks for {spec.cpus_per_worker:g} CPUs per worker; this machine has {cpus}: "
            f"use resources_per_worker={{'CPU': {cpus}}} or less (or a Ray cluster with bigger nodes)."
        )
    memory = spec.resources_per_worker.get("memory", 0)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if memory > total:
        raise ValueError(
            f"resources_per_worker asks for {memory / 2**30:.1f} GiB of memory per worker; this machine has "
            f"{total / 2**30:.1f} GiB: ask for less."
        )


def _check_gpus(spec: GroupSpec) -> None:
    from lockstep._internal.devices import usable_gpu_ids

    available = len(usable_gpu_ids())
    needed = math.ceil(spec.num_workers * spec.gpus_per_worker)
    if needed > available:
        fits = int(available // spec.gpus_per_worker) if spec.gpus_per_worker else 0
        hint = f"use num_workers={fits}" if fits >= 1 else "use a machine with GPUs"
        raise ValueError(
            f"num_workers={spec.num_workers} with {spec.gpus_per_worker:g} GPU each needs {needed} GPUs; "
            f"this machine has {available}: {hint} or use_gpu=False."
        )
