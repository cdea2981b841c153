"""Where the Ray executor's workers go: placement-group bundles, what the cluster's nodes can
hold, and the errors that say why a request can't be met."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lockstep._internal.executors.base import GroupSpec
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
