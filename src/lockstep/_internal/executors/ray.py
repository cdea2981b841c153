"""The Ray executor: each rank is a Ray actor, placed by a placement group across the cluster;
this process drives the run.

Ray places and starts the actors and says when one ends (or its node is lost); everything
else (reports, checkpoints, failures) goes over the same channel as with local processes, so
the controller can't tell the executors apart. One attempt's actors are a
:class:`~lockstep._internal.executors.ray_group.RayWorkerGroup`; this module runs the attempts
and keeps the last one's actors for the next fit.

Ranks are ordered by node (the driver's node first, then in placement order) and, within a
node, by GPU id. A "node" is a Ray node, i.e. one raylet: two raylets started on one host are
two nodes, each with its own node rank and local ranks from 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lockstep._internal.executors.base import Executor
from lockstep._internal.executors.ray_forking import names_ray
from lockstep._internal.executors.ray_group import RayWorkerGroup
from lockstep._internal.executors.ray_placement import (
    RankPlace,
    assign_ranks,
    check_request,
    cluster_capacity,
    rank_env,
)
from lockstep._internal.executors.ray_pool import POOL, KeptGroup, reuse_enabled
from lockstep._internal.payload import TrainJob, serialize_payload
from lockstep._internal.run.worker_group import GroupFactory, GroupSpec

if TYPE_CHECKING:
    from lockstep._internal.run.driver import RunDriver
    from lockstep._internal.run.validation import ValidationLauncher
    from lockstep.config import ScalingConfig
    from lockstep.result import Result
    from lockstep.validation import ValidationConfig

logger = logging.getLogger(__name__)

__all__ = ["RankPlace", "RayExecutor", "RayWorkerGroup", "assign_ranks", "rank_env"]


class RayExecutor(Executor):
    """Ray actors in a placement group for each attempt: those a previous fit of this process
    left (see :mod:`~lockstep._internal.executors.ray_pool`), else new ones; ``datasets`` are Ray
    Datasets, split per attempt into one streaming shard per rank (those ``should_split`` names).

    Raises:
        ValueError: the cluster as it is can never hold the workers (raised when it is made).
    """

    name = "ray"

    def __init__(
        self, scaling: ScalingConfig, spec: GroupSpec, datasets: Mapping[str, Any], should_split: Callable[[str], bool]
    ) -> None:
        check_request(spec)
        logger.info("Running %s workers on the Ray cluster.", scaling.num_workers)
        self.spec = spec
        self.min_workers, self.max_workers = scaling.min_workers, scaling.max_workers
        self.datasets = dict(datasets)
        self.should_split = should_split

    def validation_launcher(self, config: ValidationConfig, log_dir: str) -> ValidationLauncher:
        """Validations run as Ray tasks with ``config.ray_remote_kwargs``."""
        from lockstep._internal.executors.ray_validation import RayValidationLauncher

        return RayValidationLauncher(config)

    def launch(self, job: TrainJob, driver: RunDriver) -> Result:
        """Serialize the job once, then let the driver run attempts; keep the last attempt's
        actors for the next fit when the run ends with a Result and they ended cleanly."""
        payload = serialize_payload(job)
        job_names_ray = names_ray(job.train_fn, job.train_loop_config)
        spec = replace(self.spec, log_dir=driver.log_dir, console=driver.console)
        parked: list[KeptGroup] | None = [] if reuse_enabled() else None
        if parked is None:
            POOL.release()

        def start_group(size: int) -> RayWorkerGroup:
            for earlier in parked or []:  # a new attempt: the earlier one was not the last
                earlier.release()
            if parked:
                parked.clear()
            return RayWorkerGroup(
                spec=replace(spec, num_workers=size),
                payload=payload,
                job_names_ray=job_names_ray,
                datasets=self.datasets,
                should_split=self.should_split,
                parked=parked,
            )

        try:
            result = driver.run(
                GroupFactory(
                    executor=self.name,
                    start_group=start_group,
                    min_workers=self.min_workers,
                    max_workers=self.max_workers,
                    capacity=lambda: cluster_capacity(spec),
                )
            )
        except BaseException:
            for group in parked or []:
                group.release()
            raise
        if parked:
            for group in parked[:-1]:
                group.release()
            POOL.keep(parked[-1])
        return result
