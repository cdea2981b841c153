"""Where the Ray executor's workers go: placement-group bundles, what the cluster's nodes can
hold, the errors that say why a request can't be met, and the ranks of placed actors."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep._internal.rank.rank_env import RankEnv, threads_for
from lockstep._internal.ray_compat.ray_actor import WorkerPlace
from lockstep._internal.run.worker_group import GroupSpec
from lockstep.errors import TrainingFailedError

ACCELERATOR_SHARE = 0.001


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


def placement_problem(
    bundle: Mapping[str, float], count: int, strategy: str, nodes: list[Mapping[str, float]]
) -> str | None:
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
        f"{key}={_amount(key, value)}"
        for key, value in sorted(resources.items())
        if not key.startswith("node:") and key != "object_store_memory" and "_group_" not in key
    )


def alive_nodes() -> dict[str, dict[str, float]]:
    """The total resources of each alive node of the cluster, by a label with its IP and id."""
    import ray

    return {
        f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})": dict(node["Resources"])
        for node in ray.nodes()
        if node.get("Alive")
    }


def check_request(spec: GroupSpec, error_type: type[Exception] = ValueError) -> None:
    """Raise ``error_type`` when the cluster can never hold the workers: its nodes as they are,
    or on an autoscaling cluster (nodes come as they are needed) the most its config allows."""
    bundle = worker_bundle(spec)
    most = autoscaler_max_resources()
    if most is not None:
        _check_against_the_most(spec, bundle, most, error_type)
        return
    nodes = alive_nodes()
    problem = placement_problem(bundle, spec.num_workers, spec.placement_strategy, list(nodes.values()))
    if problem:
        raise error_type(
            f"The Ray cluster can't hold {spec.num_workers} worker(s) of {bundle} ({spec.placement_strategy}): "
            f"{problem}.\nThe cluster's nodes:\n{describe_nodes(nodes)}\n"
            "Ask for fewer workers or resources (ScalingConfig), another placement_strategy, or add nodes."
        )


def autoscaler_max_resources() -> dict[str, float] | None:
    """The most of each resource the cluster's autoscaler config allows (None: no autoscaler)."""
    try:
        from ray._private.state import state

        most = state.get_max_resources_from_cluster_config()
    except Exception:  # noqa: BLE001 - Ray's internal reader: no answer is no autoscaler
        return None
    return {key: float(value) for key, value in most.items()} if most else None


def _check_against_the_most(
    spec: GroupSpec, bundle: Mapping[str, float], most: Mapping[str, float], error_type: type[Exception]
) -> None:
    for key, amount in bundle.items():
        if key.startswith("accelerator_type:"):
            continue
        if amount * spec.num_workers > most.get(key, 0.0):
            raise error_type(
                f"The Ray cluster can't hold {spec.num_workers} worker(s) of {bundle}: they need "
                f"{key}={amount * spec.num_workers:g}, and its autoscaler config allows at most "
                f"{key}={most.get(key, 0.0):g}. Ask for fewer workers or resources (ScalingConfig), or "
                "allow more nodes in the cluster's config."
            )


def _placed_within(group: Any, timeout_s: float) -> bool:
    """Wait for ``group`` to be placed, in short waits (a Ctrl-C is taken between them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if group.wait(timeout_seconds=PLACEMENT_WAIT_SLICE_S):
            return True
        if time.monotonic() >= deadline:
            return False


#: How long each wait for a placement group lasts (a Ctrl-C waits for the end of one; Ray takes
#: whole seconds).
PLACEMENT_WAIT_SLICE_S = 1


def reserve(spec: GroupSpec) -> Any:
    """A ready placement group for the workers.

    Raises:
        TrainingFailedError: the cluster can never hold them, or didn't within
            ``spec.placement_timeout_s``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_request(spec, TrainingFailedError)
    bundle = worker_bundle(spec)
    group = placement_group([dict(bundle) for _ in range(spec.num_workers)], strategy=spec.placement_strategy)
    try:
        placed = _placed_within(group, spec.placement_timeout_s)
    except BaseException:  # Ctrl-C while waiting: the group must not keep holding its resources
        remove_placement_group(group)
        raise
    if placed:
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
            ranked.append(
                RankPlace(
                    actor_index=index,
                    world_rank=len(ranked),
                    local_rank=local_rank,
                    local_world_size=len(on_node),
                    node_rank=node_rank,
                    place=places[index],
                )
            )
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
        world_rank=rank.world_rank,
        world_size=len(ranks),
        local_rank=rank.local_rank,
        local_world_size=rank.local_world_size,
        node_rank=rank.node_rank,
        master_addr=ranks[0].place.node_ip,
        master_port=master_port,
        threads=threads_for(cpus),
        visible_gpus=tuple(dict.fromkeys(node_gpus)) if use_gpu else None,
        gpu_ids=rank.place.gpu_ids if use_gpu else (),
        store_is_hosted=False,
        node_addr=rank.place.node_ip,
    )
