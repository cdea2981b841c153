"""What the controller asks of a worker group, whichever executor starts it: a
:class:`WorkerGroup` (start a group of ranks, hand the controller what they say, answer them,
stop them), the :class:`GroupFactory` that starts one per attempt, and the :class:`WorkerExited`
event. Below both the controller and the executors: neither imports the other for it."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import cloudpickle

from lockstep.errors import TrainingFailedError

if TYPE_CHECKING:
    from lockstep._internal.wire.protocol import Finished


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
    console: Literal["rank0", "all", "none"] = "rank0"
    placement_strategy: str = "PACK"
    accelerator_type: str | None = None
    placement_timeout_s: float = 60.0


class WorkerGroup(abc.ABC):
    """A running group of ``num_workers`` ranks.

    Events are the worker messages of :mod:`lockstep._internal.wire.protocol` plus
    :class:`WorkerExited`.
    """

    @abc.abstractmethod
    def start(self) -> None:
        """Launch every worker (in parallel)."""

    @abc.abstractmethod
    def wait_events(self, timeout: float | None) -> list[Any]:
        """Block until at least one event is available (or ``timeout`` passes) and return them."""

    @abc.abstractmethod
    def send(self, rank: int, message: Any) -> None:
        """Send one driver message to a rank."""

    def send_all(self, message: Any, ranks: range) -> None:
        """Send one driver message to every rank of the group (``ranks``: all of them)."""
        for rank in ranks:
            self.send(rank, message)

    def output_tail(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr, and where its full log is."""
        return ""

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """The current Python stack of each rank in ``ranks`` (those that can tell)."""
        return {}

    def return_value(self, finished: Finished) -> Any:
        """Rank 0's return value, from its Finished message (pickled by a worker this group
        started and authenticated)."""
        return cloudpickle.loads(finished.return_value) if finished.return_value is not None else None

    @abc.abstractmethod
    def stop(self) -> None:
        """Kill every worker and whatever it started; idempotent."""


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
