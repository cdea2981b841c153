"""Ray actors kept between the fits of one driver.

Starting a Ray actor means starting a Python that imports torch and lockstep: seconds. A driver
that calls ``fit()`` again and again (a sweep, a notebook) would pay that every time, so the
actors (and their placement group) of a fit that ended cleanly are kept, idle, and the next
``fit()`` of this process that asks for the same shape sends its job to them instead.

Kept: only the actors of the last attempt of a fit that returned a Result (its train function
returned on every rank, or the run was stopped and every rank left at the stop), never after a
failure, a killed or lost actor, a preemption, or an attempt the controller ended itself.

Released (actors killed, placement group removed): when a fit asks for another shape, after
:data:`IDLE_TIMEOUT_S` unused, when this process exits, or by :func:`release_kept_actors`. After
``ray.shutdown()`` (or when the cluster is gone) Ray itself ends the job's actors and placement
groups; the handles kept here are then only forgotten.

``LOCKSTEP_WARM_START=0`` (the setting that turns off the local warm start) turns this off too.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.run.worker_group import GroupSpec

logger = logging.getLogger(__name__)

#: How long kept actors wait, idle, for the next fit before they are released.
IDLE_TIMEOUT_S = 300.0
#: How long a kept actor may take to answer before it counts as gone.
PING_TIMEOUT_S = 10.0
#: How long releasing may hold up this process's exit.
EXIT_RELEASE_WAIT_S = 5.0


@dataclass(frozen=True)
class Shape:
    """What a fit must ask for to reuse kept actors: the same workers and resources, the same
    placement, in the same Ray job (so the same cluster and runtime environment)."""

    num_workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    use_gpu: bool
    resources: tuple[tuple[str, float], ...]
    placement_strategy: str
    accelerator_type: str | None
    ray_job: tuple[str, str]


def shape_of(spec: GroupSpec) -> Shape:
    """The shape of a group of ``spec`` in this process's current Ray job."""
    return Shape(
        num_workers=spec.num_workers,
        cpus_per_worker=float(spec.cpus_per_worker),
        gpus_per_worker=float(spec.gpus_per_worker),
        use_gpu=spec.use_gpu,
        resources=tuple(sorted((key, float(amount)) for key, amount in spec.resources_per_worker.items())),
        placement_strategy=spec.placement_strategy,
        accelerator_type=spec.accelerator_type,
        ray_job=current_ray_job(),
    )


def current_ray_job() -> tuple[str, str]:
    """This driver's Ray job: (GCS address, job id); empty strings when Ray is not connected."""
    import ray

    if not ray.is_initialized():
        return ("", "")
    context = ray.get_runtime_context()
    return (str(context.gcs_address), context.get_job_id())


def reuse_enabled() -> bool:
    """Whether kept actors may be reused (``LOCKSTEP_WARM_START``, on unless 0/false/off/no)."""
    from lockstep._internal.warm.warm_start import enabled

    return enabled()


@dataclass
class KeptGroup:
    """Idle actors in world-rank order, where they are (``places``: RankPlace), and their
    placement group."""

    shape: Shape
    actors: list[Any]
    places: list[Any]
    placement_group: Any
    kept_at: float = field(default_factory=time.monotonic)

    def release(self) -> None:
        """Kill the actors and remove the placement group (only forget them when this process
        is no longer the Ray job that owns them: Ray has ended them with the job)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if current_ray_job() != self.shape.ray_job:
            logger.debug("Kept Ray actors belong to an earlier Ray job; Ray ended them with it.")
            return
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as error:  # noqa: BLE001 - a gone actor or cluster: nothing left to free
                logger.debug("Could not kill a kept Ray actor: %s", error)
        try:
            remove_placement_group(self.placement_group)
        except Exception as error:  # noqa: BLE001
            logger.debug("Could not remove a kept placement group: %s", error)

    def answers(self) -> bool:
        """Whether every actor is alive and answers within :data:`PING_TIMEOUT_S`."""
        import ray

        try:
            ray.get([actor.ready.remote() for actor in self.actors], timeout=PING_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any error means: start afresh
            logger.info("Kept Ray actors can't be reused (%s); starting new ones.", str(error).splitlines()[0])
            return False
        return True


class ActorPool:
    """The one kept group of this process (at most one: it holds cluster resources)."""

    def __init__(self, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._kept: KeptGroup | None = None
        self._timer: threading.Timer | None = None
        self._atexit_registered = False

    @property
    def kept(self) -> KeptGroup | None:
        """The kept group, if any."""
        return self._kept

    def take(self, shape: Shape) -> KeptGroup | None:
        """The kept group when it has ``shape`` and answers (it is then no longer kept); else
        None, and a kept group of another shape is released, so its resources are free."""
        with self._lock:
            kept, self._kept = self._kept, None
            self._cancel_timer()
        if kept is None:
            return None
        if kept.shape != shape or not reuse_enabled():
            logger.info("Releasing the kept Ray actors: this fit asks for another shape.")
            kept.release()
            return None
        if not kept.answers():
            kept.release()
            return None
        logger.info("Reusing %d Ray actors kept from the previous fit.", len(kept.actors))
        return kept

    def keep(self, group: KeptGroup) -> None:
        """Keep ``group`` idle for the next fit (releasing one kept before), or release it at
        once when reuse is off."""
        if not reuse_enabled():
            group.release()
            return
        with self._lock:
            previous, self._kept = self._kept, group
            self._cancel_timer()
            self._timer = threading.Timer(self.idle_timeout_s, self._release_idle, args=(group,))
            self._timer.daemon = True  # never holds up the interpreter's exit
            self._timer.name = "lockstep-ray-idle"
            self._timer.start()
            if not self._atexit_registered:
                atexit.register(self._release_at_exit)  # after ray.init's own: runs before Ray shuts down
                self._atexit_registered = True
        if previous is not None:
            previous.release()
        logger.debug("Keeping %d Ray actors for the next fit (up to %g s).", len(group.actors), self.idle_timeout_s)

    def release(self) -> None:
        """Release the kept group, if any."""
        with self._lock:
            kept, self._kept = self._kept, None
            self._cancel_timer()
        if kept is not None:
            kept.release()

    def _release_idle(self, group: KeptGroup) -> None:
        with self._lock:
            if self._kept is not group:
                return
            self._kept = None
        logger.info("Releasing the Ray actors kept since the last fit (unused for %g s).", self.idle_timeout_s)
        group.release()

    def _release_at_exit(self) -> None:
        """Release within :data:`EXIT_RELEASE_WAIT_S`: a cluster that is gone must not hang the exit."""
        releasing = threading.Thread(target=self.release, daemon=True, name="lockstep-ray-release")
        releasing.start()
        releasing.join(EXIT_RELEASE_WAIT_S)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


#: This process's pool.
POOL = ActorPool()


def release_kept_actors() -> None:
    """Kill the Ray actors kept for the next ``fit()`` of this process and free their resources."""
    POOL.release()
