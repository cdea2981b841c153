"""The Ray executor's first steps: importing Ray (or saying how to install it), making this
process a Ray driver, and splitting Ray Datasets into one iterator per rank."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lockstep[ray]'"


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


def split_datasets(
    datasets: Mapping[str, Any], count: int, should_split: Callable[[str], bool]
) -> list[dict[str, Any]]:
    """One dict of data iterators per rank: an equal streaming split of each dataset to split,
    and an iterator over the whole dataset for the others."""
    shards: list[dict[str, Any]] = [{} for _ in range(count)]
    for name, dataset in datasets.items():
        parts = (
            dataset.streaming_split(count, equal=True)
            if should_split(name)
            else [dataset.iterator() for _ in range(count)]
        )
        for rank, part in enumerate(parts):
            shards[rank][name] = part
    return shards
