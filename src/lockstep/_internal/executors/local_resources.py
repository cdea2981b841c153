"""What this machine can hold: the local executor's checks of a request before anything starts,
and the CPUs that the fits running at once in this process ask for together."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from lockstep._internal.run.worker_group import GroupSpec

logger = logging.getLogger(__name__)

LOCAL_RESOURCE_KEYS = ("CPU", "GPU", "memory")

_cpus_lock = threading.Lock()
_cpus_in_use: list[float] = []  # one entry per local fit running in this process
_warned_together = False


def local_capacity(spec: GroupSpec) -> int:
    """How many workers of ``spec`` this machine holds: the CPUs this process may run on (its
    affinity, as ``taskset`` sets it) and, with GPUs, the usable GPUs."""
    fits = int(len(os.sched_getaffinity(0)) // spec.cpus_per_worker) if spec.cpus_per_worker > 0 else 1_000_000
    if spec.use_gpu and spec.gpus_per_worker > 0:
        from lockstep._internal.rank.devices import usable_gpu_ids

        fits = min(fits, int(len(usable_gpu_ids()) // spec.gpus_per_worker))
    return fits


def check_local_resources(spec: GroupSpec) -> None:
    """Refuse requests this machine can't meet; warn about CPU oversubscription."""
    unknown = sorted(set(spec.resources_per_worker) - set(LOCAL_RESOURCE_KEYS))
    if unknown:
        raise ValueError(
            f"ScalingConfig.resources_per_worker asks for {unknown}, which the local executor doesn't "
            f"provide (it knows {', '.join(LOCAL_RESOURCE_KEYS)}). Custom resources are for Ray "
            "clusters: call ray.init(...) before fit(), or remove them."
        )
    if spec.use_gpu:
        _check_gpus(spec)
    cpus = os.cpu_count() or 1
    _check_fits_one_machine(spec, cpus)
    wanted = spec.num_workers * spec.cpus_per_worker
    if wanted > cpus:
        logger.warning(
            "%d workers x %g CPUs = %g CPUs, but this machine has %d; they will share cores and run slower.",
            spec.num_workers,
            spec.cpus_per_worker,
            wanted,
            cpus,
        )


def _check_fits_one_machine(spec: GroupSpec, cpus: int) -> None:
    """One worker asking for more CPUs or memory than this machine has can never run."""
    if spec.cpus_per_worker > cpus:
        raise ValueError(
            f"resources_per_worker asks for {spec.cpus_per_worker:g} CPUs per worker; this machine has {cpus}: "
            f"use resources_per_worker={{'CPU': {cpus}}} or less (or a Ray cluster with bigger nodes)."
        )
    memory = spec.resources_per_worker.get("memory", 0)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if memory > total:
        raise ValueError(
            f"resources_per_worker asks for {memory / 2**30:.1f} GiB of memory per worker; this machine has "
            f"{total / 2**30:.1f} GiB: ask for less."
        )


def _check_gpus(spec: GroupSpec) -> None:
    from lockstep._internal.rank.devices import usable_gpu_ids

    available = len(usable_gpu_ids())
    needed = math.ceil(spec.num_workers * spec.gpus_per_worker)
    if needed > available:
        fits = int(available // spec.gpus_per_worker) if spec.gpus_per_worker else 0
        hint = f"use num_workers={fits}" if fits >= 1 else "use a machine with GPUs"
        raise ValueError(
            f"num_workers={spec.num_workers} with {spec.gpus_per_worker:g} GPU each needs {needed} GPUs; "
            f"this machine has {available}: {hint} or use_gpu=False."
        )


@contextmanager
def cpus_in_use(cpus: float) -> Iterator[None]:
    """While a local fit whose workers ask for ``cpus`` runs: count them with those of the other
    fits running in this process (threads, e.g. an Optuna study with ``n_jobs=2``), and say
    once per process when together they want more CPUs than the machine has."""
    global _warned_together
    with _cpus_lock:
        _cpus_in_use.append(cpus)
        total, fits, warn = sum(_cpus_in_use), len(_cpus_in_use), False
        machine = os.cpu_count() or 1
        if fits > 1 and total > machine and not _warned_together:
            _warned_together = warn = True
    if warn:
        logger.warning(
            "%d fits at once ask for %g CPUs in all, but this machine has %d; their workers will share "
            "cores and run slower (run fewer at once, e.g. Optuna's n_jobs).",
            fits,
            total,
            machine,
        )
    try:
        yield
    finally:
        with _cpus_lock:
            _cpus_in_use.remove(cpus)
