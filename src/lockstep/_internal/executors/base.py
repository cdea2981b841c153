"""The one interface every executor implements: start a group of workers, hand the
controller what they say, answer them, and stop them."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerExited:
    """A worker process ended (``returncode`` as ``subprocess`` gives it: negative = signal).
    ``cause`` is the executor's own account of why, when it has one (e.g. Ray's)."""

    rank: int
    returncode: int
    cause: str | None = None


@dataclass(frozen=True)
class GroupSpec:
    """What the controller asks an executor for."""

    num_workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    use_gpu: bool
    resources_per_worker: dict[str, float]
    log_dir: str | None = None
    console: str = "rank0"
    placement_strategy: str = "PACK"
    accelerator_type: str | None = None
    placement_timeout_s: float = 60.0


class WorkerGroup(abc.ABC):
    """A running group of ``num_workers`` ranks.

    Events are the worker messages of :mod:`lockstep._internal.protocol` plus
    :class:`WorkerExited`.
    """

    @abc.abstractmethod
    def start(self, payload: bytes) -> None:
        """Launch every worker (in parallel) with the serialized payload."""

    @abc.abstractmethod
    def wait_events(self, timeout: float | None) -> list[Any]:
        """Block until at least one event is available (or ``timeout`` passes) and return them."""

    @abc.abstractmethod
    def send(self, rank: int, message: Any) -> None:
        """Send one driver message to a rank."""

    def output_tail(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr, and where its full log is."""
        return ""

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """The current Python stack of each rank in ``ranks`` (those that can tell)."""
        return {}

    @abc.abstractmethod
    def stop(self) -> None:
        """Kill every worker and whatever it started; idempotent."""
