"""The Ray executor: each rank is a Ray actor, placed by a placement group across the cluster.

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
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from lockstep._internal import protocol
from lockstep._internal.executors.base import GroupSpec, WorkerExited, WorkerGroup
from lockstep._internal.executors.channels import WorkerConnections
from lockstep._internal.executors.local import user_python_path
from lockstep._internal.ray_actor import RayWorker, WorkerPlace
from lockstep._internal.worker import ENV_GPU_IDS
from lockstep._internal.worker_output import OutputRelay
from lockstep.errors import TrainingFailedError

logger = logging.getLogger(__name__)

#: How long the driver keeps reading a rank's channel after Ray says the rank ended.
LAST_MESSAGES_WAIT_S = 10.0
STACK_DUMP_WAIT_S = 5.0  # a method call on a busy actor, possibly on another node
ACCELERATOR_SHARE = 0.001
INSTALL_HINT = "pip install 'lockstep[ray]'"


# -- choosing and connecting --------------------------------------------------------------------


def import_ray() -> Any:
    """The ``ray`` module, or a ValueError that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ValueError(f"The Ray executor needs Ray, which is not installed: {INSTALL_HINT}") from error
    return ray


def ray_is_initialized() -> bool:
    """Whether this process has called ``ray.init()`` (without importing Ray if it hasn't)."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


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


# -- placement ----------------------------------------------------------------------------------


def worker_bundle(spec: GroupSpec) -> dict[str, float]:
    """The resources of one worker, as a placement-group bundle."""
    bundle = {key: float(amount) for key, amount in spec.resources_per_worker.items() if amount > 0}
    if not spec.use_gpu:
        bundle.pop("GPU", None)
    if spec.accelerator_type:
        bundle[f"accelerator_type:{spec.accelerator_type}"] = ACCELERATOR_SHARE
    return bundle


def workers_fitting(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many bundles fit on a node with these total resources."""
    counts = [int(node.get(key, 0.0) / amount + 1e-9) for key, amount in bundle.items() if amount > 0]
    return min(counts) if counts else 1_000_000


def placement_capacity(bundle: Mapping[str, float], strategy: str, nodes: list[Mapping[str, float]]) -> int:
    """How many bundles ``nodes`` (each node's total resources) can hold with ``strategy``."""
    fits = [workers_fitting(node, bundle) for node in nodes]
    if strategy == "STRICT_PACK":
        return max(fits, default=0)
    if strategy == "STRICT_SPREAD":
        return sum(1 for fit in fits if fit >= 1)
    return sum(fits)


def cluster_capacity(spec: GroupSpec) -> int:
    """How many workers of ``spec`` the cluster's alive nodes hold (an elastic run's size)."""
    return placement_capacity(worker_bundle(spec), spec.placement_strategy, list(alive_nodes().values()))


def placement_problem(bundle: Mapping[str, float], count: int, strategy: str, nodes: list[Mapping[str, float]]) -> str | None:
    """Why ``count`` bundles can never be placed with ``strategy`` on ``nodes`` (each node's
    total resources), or None when they can."""
    fits = [workers_fitting(node, bundle) for node in nodes]
    if strategy == "STRICT_PACK" and max(fits, default=0) < count:
        return f"STRICT_PACK needs all {count} workers on one node, and no node holds more than {max(fits, default=0)}"
    if strategy == "STRICT_SPREAD" and sum(1 for fit in fits if fit >= 1) < count:
        return f"STRICT_SPREAD needs {count} nodes that each hold a worker, and {sum(1 for fit in fits if fit >= 1)} do"
    if sum(fits) < count:
        return f"the cluster's nodes hold at most {sum(fits)} such workers in all"
    return None


def describe_nodes(nodes: Mapping[str, Mapping[str, float]]) -> str:
    """The nodes' resources, one line each, for error messages."""
    shown = []
    for label, node in nodes.items():
        shown.append(f"  {label}: {_short_resources(node) or 'nothing'}")
    return "\n".join(shown) or "  (no alive nodes)"


def _amount(key: str, value: float) -> str:
    return f"{value / 2**30:.1f}GiB" if key == "memory" else f"{value:g}"


def _short_resources(resources: Mapping[str, float]) -> str:
    """The resources that mean something to a user (not Ray's per-node markers or its object store)."""
    return ", ".join(
        f"{key}={_amount(key, value)}" for key, value in sorted(resources.items())
        if not key.startswith("node:") and key != "object_store_memory"
    )


def alive_nodes() -> dict[str, dict[str, float]]:
    """The total resources of each alive node of the cluster, by a label with its IP and id."""
    import ray

    return {
        f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})": dict(node["Resources"])
        for node in ray.nodes() if node.get("Alive")
    }


def check_request(spec: GroupSpec, error_type: type[Exception] = ValueError) -> None:
    """Raise ``error_type`` when the cluster as it is can never hold the workers."""
    bundle = worker_bundle(spec)
    nodes = alive_nodes()
    problem = placement_problem(bundle, spec.num_workers, spec.placement_strategy, list(nodes.values()))
    if problem:
        raise error_type(
            f"The Ray cluster can't hold {spec.num_workers} worker(s) of {bundle} ({spec.placement_strategy}): "
            f"{problem}.\nThe cluster's nodes:\n{describe_nodes(nodes)}\n"
            "Ask for fewer workers or resources (ScalingConfig), another placement_strategy, or add nodes."
        )


def reserve(spec: GroupSpec) -> Any:
    """A ready placement group for the workers.

    Raises:
        TrainingFailedError: the cluster can never hold them, or didn't within
            ``spec.placement_timeout_s``.
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    import ray

    check_request(spec, TrainingFailedError)
    bundle = worker_bundle(spec)
    group = placement_group([dict(bundle) for _ in range(spec.num_workers)], strategy=spec.placement_strategy)
    if group.wait(timeout_seconds=spec.placement_timeout_s):
        return group
    remove_placement_group(group)
    available = ray.available_resources()
    raise TrainingFailedError(
        f"Ray could not place {spec.num_workers} worker(s) of {bundle} ({spec.placement_strategy}) within "
        f"{spec.placement_timeout_s:g} s (ScalingConfig.placement_timeout_s): other work holds the resources. "
        f"Available now: {_short_resources(available)}.\nThe cluster's nodes:\n{describe_nodes(alive_nodes())}\n"
        "Free resources, add nodes, ask for less, or wait longer."
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


def rank_env(ranks: list[RankPlace], rank: RankPlace, master_port: int, cpus: float, use_gpu: bool) -> dict[str, str]:
    """The environment of one rank (without the driver's address)."""
    master = ranks[0].place
    env = {
        "RANK": str(rank.world_rank),
        "LOCAL_RANK": str(rank.local_rank),
        "WORLD_SIZE": str(len(ranks)),
        "LOCAL_WORLD_SIZE": str(rank.local_world_size),
        "NODE_RANK": str(rank.node_rank),
        "GROUP_RANK": str(rank.node_rank),
        "MASTER_ADDR": master.node_ip,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": str(max(1, int(cpus))),
        "PYTHONUNBUFFERED": "1",
    }
    if use_gpu:
        node_gpus = [gpu for other in ranks if other.node_rank == rank.node_rank for gpu in other.place.gpu_ids]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(node_gpus))
        env[ENV_GPU_IDS] = ",".join(rank.place.gpu_ids)
    return env


# -- datasets -----------------------------------------------------------------------------------


def is_ray_dataset(value: Any) -> bool:
    """Whether ``value`` is a ``ray.data.Dataset`` (checked without importing Ray)."""
    return type(value).__module__.startswith("ray.data") and hasattr(value, "streaming_split")


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


class RayWorkerGroup(WorkerGroup):
    """``num_workers`` Ray actors in one placement group."""

    def __init__(
        self, spec: GroupSpec, datasets: Mapping[str, Any] | None = None,
        should_split: Callable[[str], bool] = lambda name: True,
    ) -> None:
        import ray

        self.spec = spec
        self.datasets = dict(datasets or {})
        self.should_split = should_split
        self._channels = WorkerConnections(ray.util.get_node_ip_address())
        self._placement_group: Any = None
        self._actors: list[Any] = []
        self._places: list[RankPlace] = []
        self._ended: queue.SimpleQueue[WorkerExited] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._watcher: threading.Thread | None = None
        self._output = OutputRelay(spec.log_dir, spec.console) if spec.log_dir else None

    # -- start ---------------------------------------------------------------------------------

    def start(self, payload: bytes) -> None:
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
        self._run_all(ray.put(payload))

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
            env = rank_env(self._places, rank, master_port, self.spec.cpus_per_worker, self.spec.use_gpu)
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
        events: list[Any] = []
        ended: list[WorkerExited] = []
        for ready in wait([*self._channels.waitables(), self._wake_read], timeout):
            if self._channels.owns(ready):
                events += self._channels.read(ready)
            else:
                os.read(self._wake_read, 4096)
                while not self._ended.empty():
                    ended.append(self._ended.get())
        for exited in ended:
            events += self._channels.drain_rank(exited.rank, until_closed_s=LAST_MESSAGES_WAIT_S)
            events.append(exited)
        return self._without_output(events)

    def _without_output(self, events: list[Any]) -> list[Any]:
        """Hand the workers' output to the relay (logs, console); return the other events."""
        others = []
        for event in events:
            if isinstance(event, protocol.Output):
                if self._output is not None:
                    self._output.write(event.rank, event.data, event.is_stderr)
            else:
                others.append(event)
        return others

    def send(self, rank: int, message: Any) -> None:
        """Send a message to a rank (ignored if that rank is already gone)."""
        self._channels.send(rank, message)

    # -- diagnostics ---------------------------------------------------------------------------

    def output_tail(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr, and where its full log is."""
        return self._output.tail_with_log_path(rank) if self._output is not None else ""

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
        self._channels.close()
        if self._output is not None:
            self._output.close()
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
