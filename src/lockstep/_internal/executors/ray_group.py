"""One attempt's ranks on Ray: ``num_workers`` actors in a placement group (or kept ones of a
previous fit), each running the job, its rank forked on its node where
:func:`~lockstep._internal.executors.ray_forking.forks_ranks` allows. Ray says when an actor's run
ends or its node is lost or drained; reports, checkpoints and failures come over the channels
(:class:`~lockstep._internal.executors.channels.ChannelGroup`), as with local processes.
The executor that makes one per attempt is :mod:`lockstep._internal.executors.ray`.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from lockstep._internal.executors.channels import ChannelGroup
from lockstep._internal.executors.ray_connect import split_datasets
from lockstep._internal.executors.ray_drain import DrainWatcher
from lockstep._internal.executors.ray_forking import forks_ranks, start_forkers
from lockstep._internal.executors.ray_placement import RankPlace, assign_ranks, rank_env, reserve, worker_bundle
from lockstep._internal.executors.ray_pool import POOL, KeptGroup, shape_of
from lockstep._internal.rank.python_path import user_python_path
from lockstep._internal.ray_compat.ray_actor import RayWorker
from lockstep._internal.run.worker_group import GroupSpec, WorkerExited
from lockstep._internal.wire import protocol
from lockstep.errors import TrainingFailedError

logger = logging.getLogger(__name__)

__all__ = ["LAST_MESSAGES_WAIT_S", "STACK_DUMP_WAIT_S", "RayWorkerGroup"]

#: How long the driver keeps reading a rank's channel after Ray says the rank ended.
LAST_MESSAGES_WAIT_S = 10.0
STACK_DUMP_WAIT_S = 5.0  # a method call on a busy actor, possibly on another node


class RayWorkerGroup(ChannelGroup):
    """``num_workers`` Ray actors in one placement group, each running the serialized job
    ``payload``. With ``parked`` (a list), the group first asks the pool for kept actors of its
    shape, and ``stop`` appends its actors there instead of killing them when every rank ended
    cleanly (the executor then keeps or releases them). The ranks are forked on their nodes
    unless the job names Ray (``job_names_ray`` says where) or another rule of
    :func:`~lockstep._internal.executors.ray_forking.forks_ranks` keeps them in their actors."""

    def __init__(
        self,
        spec: GroupSpec,
        payload: bytes,
        datasets: Mapping[str, Any] | None = None,
        should_split: Callable[[str], bool] = lambda name: True,
        parked: list[KeptGroup] | None = None,
        job_names_ray: str | None = None,
    ) -> None:
        import ray

        super().__init__(ray.util.get_node_ip_address(), spec.num_workers, spec.log_dir, spec.console)
        self.spec = spec
        self.payload = payload
        self.datasets = dict(datasets or {})
        self.should_split = should_split
        self.job_names_ray = job_names_ray
        self._placement_group: Any = None
        self._actors: list[Any] = []
        self._places: list[RankPlace] = []
        self._ended: queue.SimpleQueue[WorkerExited] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._channels.watch(self._wake_read)
        self._watcher: threading.Thread | None = None
        self._drains: DrainWatcher | None = None
        self._parked = parked
        self._left_cleanly: set[int] = set()
        self._exits: dict[int, WorkerExited] = {}

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Take kept actors of this shape, or reserve the placement group, start one actor per
        bundle and give them ranks; then run them."""
        import ray

        kept = POOL.take(shape_of(self.spec)) if self._parked is not None else None
        if kept is not None:
            self._placement_group, self._actors, self._places = (
                kept.placement_group,
                list(kept.actors),
                list(kept.places),
            )
        else:
            self._start_actors()
        self._run_all(ray.put(self.payload))
        self._drains = DrainWatcher(self._places, self._wake)

    def _start_actors(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._placement_group = reserve(self.spec)
        actor_class = ray.remote(RayWorker)
        bundle = worker_bundle(self.spec)
        actors: list[Any] = [
            actor_class.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                memory=bundle.get("memory"),
                resources={key: value for key, value in bundle.items() if key not in ("CPU", "GPU", "memory")},
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=index
                ),
            ).remote()
            for index in range(self.spec.num_workers)
        ]
        self._actors = actors
        places = self._get([actor.place.remote() for actor in actors], "start")
        self._places = assign_ranks(places, ray.get_runtime_context().get_node_id())
        self._actors = [actors[rank.actor_index] for rank in self._places]
        logger.debug(
            "Ray actors placed: %s",
            [(rank.world_rank, rank.place.node_ip, rank.place.node_id[:8]) for rank in self._places],
        )

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
        forkers = (
            start_forkers(self._places, self._actors, self.payload, self._get)
            if forks_ranks(self.spec, shards, self.job_names_ray)
            else {}
        )
        runs = {}
        for rank, actor in zip(self._places, self._actors, strict=True):
            env = rank_env(
                ranks=self._places,
                rank=rank,
                master_port=master_port,
                cpus=self.spec.cpus_per_worker,
                use_gpu=self.spec.use_gpu,
            ).variables()
            env.update(self._channels.worker_env(rank.world_rank))
            forker = forkers.get(rank.place.node_id)
            run = actor.run.remote(payload_ref, env, shards[rank.world_rank], user_python_path(), forker=forker)
            runs[run] = rank.world_rank
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
                if not self._wake():
                    return

    def _wake(self) -> bool:
        """Make the controller's wait return (from another thread); False once the pipe is closed."""
        try:
            os.write(self._wake_write, b"!")
        except OSError:
            return False
        return True

    # -- events --------------------------------------------------------------------------------

    def wait_events(self, timeout: float | None) -> list[Any]:
        """Wait on the workers' channels and on Ray's news of ended actors and drained nodes together."""
        events, woken = self._wait(timeout)
        events += self._drains.take() if self._drains is not None else []
        ended: list[WorkerExited] = []
        if woken:
            os.read(self._wake_read, 4096)
            while not self._ended.empty():
                ended.append(self._ended.get())
        for exited in ended:
            events += self._relayed(self._channels.drain_rank(exited.rank, until_closed_s=LAST_MESSAGES_WAIT_S))
            events.append(exited)
            self._exits[exited.rank] = exited
        self._left_cleanly.update(_ranks_leaving_cleanly(events))
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
        """Kill every actor and release the placement group (or, when every rank ended cleanly
        and reuse is on, park them for the executor); close the channels."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._drains is not None:
            self._drains.stop()
        if self._parked is not None and self._placement_group is not None and self._ended_cleanly():
            self._parked.append(KeptGroup(shape_of(self.spec), self._actors, self._places, self._placement_group))
            self._placement_group = None  # parked: neither killed nor removed here
        else:
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
        if self._watcher is not None:
            self._watcher.join(LAST_MESSAGES_WAIT_S)
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
        self._close_channels()  # (which stops watching the wake-up pipe)
        if self._watcher is None or not self._watcher.is_alive():  # else it may still write to the pipe
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_read = self._wake_write = -1
        self._actors = []

    def _ended_cleanly(self) -> bool:
        """Whether the actors may be kept: every rank's run returned after its train function
        returned or it left at a stop (no failure, no dead actor)."""
        ranks = set(range(len(self._actors)))
        return (
            bool(ranks)
            and self._left_cleanly == ranks
            and set(self._exits) == ranks
            and all(exited.cause is None and exited.returncode in (0, 1) for exited in self._exits.values())
        )


def _ranks_leaving_cleanly(events: list[Any]) -> set[int]:
    """The ranks whose train function returned, or that left at a stop (a preemption's too: a
    preempted run raises, and the executor then keeps nothing)."""
    ranks = {event.rank for event in events if isinstance(event, protocol.Finished)}
    return ranks | {
        event.failure.rank
        for event in events
        if isinstance(event, protocol.Failed) and event.failure.error_type == "PreemptionStop"
    }


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
    """The first ``count`` lines of Ray's error, and its last (the exception itself, after a
    traceback), on one line."""
    text = _ANSI_CODES.sub("", text)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip().strip("^~") != ""]
    shown = lines[:count] + (["…", lines[-1]] if len(lines) > count else [])
    return " ".join(shown)


#: The terminal colour codes Ray puts in its errors' first lines.
_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")
