"""The Ray executor: each rank is a Ray actor, placed by a placement group across the cluster;
this process drives the run.

Ray places and starts the actors and says when one ends (or its node is lost); everything
else (reports, checkpoints, failures) goes over the same channel as with local processes, so
the controller can't tell the executors apart.

Ranks are ordered by node (the driver's node first, then in placement order) and, within a
node, by GPU id. A "node" is a Ray node, i.e. one raylet: two raylets started on one host are
two nodes, each with its own node rank and local ranks from 0.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from lockstep._internal.executors.base import Executor, GroupFactory, GroupSpec, WorkerExited
from lockstep._internal.executors.channels import ChannelGroup
from lockstep._internal.python_path import user_python_path
from lockstep._internal.executors.ray_placement import check_request, cluster_capacity, reserve, worker_bundle
from lockstep._internal.payload import TrainJob, serialize_payload
from lockstep._internal.rank_env import RankEnv, threads_for
from lockstep._internal.ray_actor import RayWorker, WorkerPlace
from lockstep.errors import TrainingFailedError

if TYPE_CHECKING:
    from lockstep._internal.driver import RunDriver
    from lockstep.config import ScalingConfig
    from lockstep.result import Result

logger = logging.getLogger(__name__)

#: How long the driver keeps reading a rank's channel after Ray says the rank ended.
LAST_MESSAGES_WAIT_S = 10.0
STACK_DUMP_WAIT_S = 5.0  # a method call on a busy actor, possibly on another node
INSTALL_HINT = "pip install 'lockstep[ray]'"


# -- choosing and connecting --------------------------------------------------------------------


def import_ray() -> Any:
    """The ``ray`` module, or a ValueError that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ValueError(f"The Ray executor needs Ray, which is not installed: {INSTALL_HINT}") from error
    return ray


def connect(address: str | None) -> None:
    """Make sure this process is a Ray driver: call ``ray.init(address)`` unless it already is.

    Raises:
        ValueError: Ray is missing, or this process is a Ray Client (``ray://``), whose workers
            could not reach it.
    """
    ray = import_ray()
    if not ray.is_initialized():
        logger.info("Connecting to Ray (%s).", address or "RAY_ADDRESS, else a new local cluster")
        ray.init(address=address)
    if ray.util.client.ray.is_connected():
        raise ValueError(
            "lockstep's Ray executor can't run from a Ray Client (ray://) connection: its workers talk to the "
            "driver directly. Run the script on a node of the cluster (e.g. as a Ray job)."
        )


# -- ranks --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlace:
    """Where a rank runs and who it is there."""

    actor_index: int
    world_rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    place: WorkerPlace


def assign_ranks(places: list[WorkerPlace], first_node_id: str | None = None) -> list[RankPlace]:
    """World ranks for actors at ``places``: grouped by node (``first_node_id`` first, then in
    the order nodes appear), and by GPU id within a node. Returned in world-rank order."""
    node_order = list(dict.fromkeys(place.node_id for place in places))
    if first_node_id in node_order:
        node_order.remove(first_node_id)
        node_order.insert(0, first_node_id)
    ranked: list[RankPlace] = []
    for node_rank, node_id in enumerate(node_order):
        on_node = sorted(
            (index for index, place in enumerate(places) if place.node_id == node_id),
            key=lambda index: (_gpu_sort_key(places[index].gpu_ids), index),
        )
        for local_rank, index in enumerate(on_node):
            ranked.append(RankPlace(index, len(ranked), local_rank, len(on_node), node_rank, places[index]))
    return ranked


def _gpu_sort_key(gpu_ids: tuple[str, ...]) -> tuple[int, int, str]:
    if not gpu_ids:
        return (0, 0, "")
    first = gpu_ids[0]
    return (0, int(first), "") if first.isdigit() else (1, 0, first)


def rank_env(ranks: list[RankPlace], rank: RankPlace, master_port: int, cpus: float, use_gpu: bool) -> RankEnv:
    """Who ``rank`` is: rank 0's node hosts the rendezvous store (opened by rank 0, which the
    others join), and with GPUs a rank sees every GPU of its node's ranks."""
    node_gpus = [gpu for other in ranks if other.node_rank == rank.node_rank for gpu in other.place.gpu_ids]
    return RankEnv(
        world_rank=rank.world_rank, world_size=len(ranks), local_rank=rank.local_rank,
        local_world_size=rank.local_world_size, node_rank=rank.node_rank, master_addr=ranks[0].place.node_ip,
        master_port=master_port, threads=threads_for(cpus), visible_gpus=tuple(dict.fromkeys(node_gpus)) if use_gpu else None,
        gpu_ids=rank.place.gpu_ids if use_gpu else (), store_is_hosted=False, node_addr=rank.place.node_ip,
    )


# -- datasets -----------------------------------------------------------------------------------


def split_datasets(datasets: Mapping[str, Any], count: int, should_split: Callable[[str], bool]) -> list[dict[str, Any]]:
    """One dict of data iterators per rank: an equal streaming split of each dataset to split,
    and an iterator over the whole dataset for the others."""
    shards: list[dict[str, Any]] = [{} for _ in range(count)]
    for name, dataset in datasets.items():
        parts = dataset.streaming_split(count, equal=True) if should_split(name) else [dataset.iterator() for _ in range(count)]
        for rank, part in enumerate(parts):
            shards[rank][name] = part
    return shards


# -- the group ----------------------------------------------------------------------------------


class RayExecutor(Executor):
    """Ray actors in a placement group, started afresh for each attempt; ``datasets`` are Ray
    Datasets, split per attempt into one streaming shard per rank (those ``should_split`` names).

    Raises:
        ValueError: the cluster as it is can never hold the workers (raised when it is made).
    """

    name = "ray"

    def __init__(self, scaling: ScalingConfig, spec: GroupSpec, datasets: Mapping[str, Any],
                 should_split: Callable[[str], bool]) -> None:
        check_request(spec)
        logger.info("Running %s workers on the Ray cluster.", scaling.num_workers)
        self.spec = spec
        self.min_workers, self.max_workers = scaling.min_workers, scaling.max_workers
        self.datasets = dict(datasets)
        self.should_split = should_split

    def launch(self, job: TrainJob, driver: RunDriver) -> Result:
        """Serialize the job once, then let the driver run attempts of fresh actors."""
        payload = serialize_payload(job)
        spec = replace(self.spec, log_dir=driver.log_dir, console=driver.console)

        def start_group(size: int) -> RayWorkerGroup:
            return RayWorkerGroup(replace(spec, num_workers=size), payload, self.datasets, self.should_split)

        return driver.run(GroupFactory(self.name, start_group, self.min_workers, self.max_workers,
                                       lambda: cluster_capacity(spec)))


class RayWorkerGroup(ChannelGroup):
    """``num_workers`` Ray actors in one placement group, each running the serialized job ``payload``."""

    def __init__(
        self, spec: GroupSpec, payload: bytes, datasets: Mapping[str, Any] | None = None,
        should_split: Callable[[str], bool] = lambda name: True,
    ) -> None:
        import ray

        super().__init__(ray.util.get_node_ip_address(), spec.log_dir, spec.console)
        self.spec = spec
        self.payload = payload
        self.datasets = dict(datasets or {})
        self.should_split = should_split
        self._placement_group: Any = None
        self._actors: list[Any] = []
        self._places: list[RankPlace] = []
        self._ended: queue.SimpleQueue[WorkerExited] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._watcher: threading.Thread | None = None

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Reserve the placement group, start one actor per bundle, give them ranks and run them."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._placement_group = reserve(self.spec)
        actor_class = ray.remote(RayWorker)
        bundle = worker_bundle(self.spec)
        actors = [
            actor_class.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), memory=bundle.get("memory"),
                resources={key: value for key, value in bundle.items() if key not in ("CPU", "GPU", "memory")},
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=index),
            ).remote()
            for index in range(self.spec.num_workers)
        ]
        self._actors = actors
        places = self._get([actor.place.remote() for actor in actors], "start")
        self._places = assign_ranks(places, ray.get_runtime_context().get_node_id())
        self._actors = [actors[rank.actor_index] for rank in self._places]
        logger.debug("Ray actors placed: %s", [(rank.world_rank, rank.place.node_ip, rank.place.node_id[:8]) for rank in self._places])
        self._run_all(ray.put(self.payload))

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=self.spec.placement_timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            raise TrainingFailedError(
                f"The Ray actors did not {what} within {self.spec.placement_timeout_s:g} s "
                "(ScalingConfig.placement_timeout_s); see Ray's logs (e.g. /tmp/ray/session_latest/logs)."
            ) from error

    def _run_all(self, payload_ref: Any) -> None:
        (master_port,) = self._get([self._actors[0].free_port.remote()], "answer")
        shards = split_datasets(self.datasets, self.spec.num_workers, self.should_split)
        runs = {}
        for rank, actor in zip(self._places, self._actors):
            env = rank_env(self._places, rank, master_port, self.spec.cpus_per_worker, self.spec.use_gpu).variables()
            env.update(self._channels.worker_env())
            runs[actor.run.remote(payload_ref, env, shards[rank.world_rank], user_python_path())] = rank.world_rank
        self._watcher = threading.Thread(target=self._watch, args=(runs,), daemon=True, name="lockstep-ray-watch")
        self._watcher.start()

    def _watch(self, runs: dict[Any, int]) -> None:
        """Turn each finished ``run`` call into a WorkerExited (runs on its own thread)."""
        import ray

        pending = dict(runs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                self._ended.put(_exit_of(pending.pop(ref), ref))
                try:
                    os.write(self._wake_write, b"!")
                except OSError:
                    return

    # -- events --------------------------------------------------------------------------------

    def wait_events(self, timeout: float | None) -> list[Any]:
        """Wait on the workers' channels and on Ray's news of ended actors together."""
        events, woken = self._wait([self._wake_read], timeout)
        ended: list[WorkerExited] = []
        if woken:
            os.read(self._wake_read, 4096)
            while not self._ended.empty():
                ended.append(self._ended.get())
        for exited in ended:
            events += self._relayed(self._channels.drain_rank(exited.rank, until_closed_s=LAST_MESSAGES_WAIT_S))
            events.append(exited)
        return events

    # -- diagnostics ---------------------------------------------------------------------------

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each rank's actor where its train function is (up to 5 s in all)."""
        import ray

        asked = {self._actors[rank].stack.remote(): rank for rank in ranks if rank < len(self._actors)}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=STACK_DUMP_WAIT_S)
        stacks: dict[int, str] = {}
        for ref in ready:
            try:
                stacks[asked[ref]] = ray.get(ref)
            except ray.exceptions.RayError:
                continue
        return {rank: stack for rank, stack in stacks.items() if stack}

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Kill every actor, release the placement group, close the channels."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        if self._watcher is not None:
            self._watcher.join(LAST_MESSAGES_WAIT_S)
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
        self._close_channels()
        if self._watcher is None or not self._watcher.is_alive():  # else it may still write to the pipe
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_read = self._wake_write = -1
        self._actors = []


def _exit_of(rank: int, ref: Any) -> WorkerExited:
    """How a rank's ``run`` call ended, as a WorkerExited."""
    import ray

    try:
        return WorkerExited(rank, int(ray.get(ref)))
    except ray.exceptions.RayActorError as error:
        return WorkerExited(rank, -9, f"its Ray actor died: {_first_lines(str(error))}")
    except ray.exceptions.RayError as error:
        return WorkerExited(rank, 1, f"its Ray task failed: {_first_lines(str(error))}")


def _first_lines(text: str, count: int = 6) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:count])
