"""Workers warm before ``fit()``: the driver's side of the warm process.

A driver starts a fresh interpreter in the background (see :mod:`lockstep._internal.warm.zygote`)
that imports torch, lockstep's worker runtime and the installed packages the script imports,
while the driver goes on with its own imports: when ``import lockstep`` first runs in a script
(``python train.py``; :mod:`lockstep._internal.early_warm`), when ``lockstep run train.py``
starts (before the script's first line), or else when :mod:`lockstep.torch` is imported. At
``fit()`` the local executor asks it to import the installed packages the job names, then to fork
one child per rank; the warm process stays for the next ``fit()``. Set ``LOCKSTEP_WARM_START=0``
to start every worker afresh instead. This module decides when and whether; the handle on the
process and the ranks it forks are :mod:`lockstep._internal.warm.warm_handle`'s.

Nothing is started inside a worker, under torchrun, in a Ray worker, in a process started by
``multiprocessing``, outside the main thread, or off Linux. If the warm process is gone or
refuses, ``fit()`` starts the workers the plain way and logs it once.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Sequence

from lockstep._internal.switches import switched_on
from lockstep._internal.warm.warm_handle import (
    ENV_WARM_START,
    WARM_PROCESS_ENV,
    RankFiles,
    RankProcess,
    StartRank,
    WarmProcess,
    WarmStartUnavailable,
    fork_rank,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ENV_WARM_START",
    "WARM_PROCESS_ENV",
    "enabled",
    "rank_starter",
    "release_unused",
    "shutdown",
    "start_in_background",
    "warm_process_pid",
    "why_not_here",
]


def enabled() -> bool:
    """Whether the setting allows a warm process (``LOCKSTEP_WARM_START``, on unless 0/false/off)."""
    return switched_on(ENV_WARM_START)


def why_not_here() -> str | None:
    """Why this process must not start a warm process, or None when it may."""
    from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS, launched_by_launcher

    if not enabled():
        return f"{ENV_WARM_START}=0"
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return "not Linux (needs pidfd_open)"
    if ENV_DRIVER_ADDRESS in os.environ:
        return "this is one of lockstep's workers"
    if launched_by_launcher():
        return "started by torchrun"
    if _in_ray_worker():
        return "this is a Ray worker"
    import multiprocessing

    if multiprocessing.parent_process() is not None or "--multiprocessing-fork" in sys.orig_argv:
        return "started by multiprocessing"  # the flag: a spawned child still importing the main script
    if threading.current_thread() is not threading.main_thread():
        return "not the main thread (the warm process would die with this thread)"
    return None


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        worker = ray._private.worker  # private: hence the broad fallback
        return bool(worker.global_worker.mode == worker.WORKER_MODE)
    except Exception:  # noqa: BLE001
        return False


# -- the process-wide warm process ------------------------------------------------------------

_warm: WarmProcess | None = None
_fallback_logged = False
_released = False


def start_in_background(guessed: Sequence[str] = ()) -> None:
    """Start the warm process, unless one runs or this process must not have one; it also
    imports the installed modules of ``guessed`` (those the user's script imports) until the
    first ``fit()``."""
    global _warm
    if _warm is not None:
        return
    reason = why_not_here()
    if reason is not None:
        logger.debug("no warm process: %s", reason)
        return
    try:
        _warm = WarmProcess(list(guessed))
    except OSError as error:
        logger.debug("no warm process: %s", error)
        return
    atexit.register(shutdown)


def warm_process_pid() -> int | None:
    """The pid of this process's warm process, or None (for tests and diagnostics)."""
    return _warm.pid if _warm is not None and _warm.owner == os.getpid() else None


def shutdown() -> None:
    """Stop this process's warm process, if any (at exit; also when no fit will use it)."""
    global _warm
    if _warm is not None and _warm.owner == os.getpid():
        _warm.close()
    _warm = None


def release_unused(why: str) -> None:
    """Stop the warm process if no ``fit()`` has used it yet: this driver's runs go elsewhere
    (``why``: Ray), and an idle warm process holds hundreds of MiB. A later local ``fit()``
    then starts its workers the plain way and a warm process again for the fits after it."""
    global _released
    if _warm is not None and _warm.owner == os.getpid() and not _warm.used:
        logger.debug("stopping the unused warm process: %s", why)
        shutdown()
        _released = True


def rank_starter(payload: bytes, plain: StartRank) -> StartRank:
    """How this ``fit()`` starts a rank: ``start(env, files, piped)``. Forked by the warm
    process when there is one (first told what to import), else (or once it fails) ``plain``."""
    global _released
    warm = _warm
    if warm is None and _released and enabled():
        _released = False
        start_in_background()  # for the next fit: a local one came after all
        return plain
    if warm is None or warm.owner != os.getpid():
        return plain
    if not enabled():  # turned off after the import
        shutdown()
        return plain
    try:
        if not warm.alive():
            raise WarmStartUnavailable(f"it exited (code {warm.process.returncode})")
        warm.prepare(payload)
    except WarmStartUnavailable as error:
        _give_up(error)
        return plain

    def start(env: dict[str, str], files: RankFiles, piped: bool) -> RankProcess:
        if _warm is not warm:
            return plain(env, files, piped)
        try:
            return fork_rank(warm, env, files, piped)
        except WarmStartUnavailable as error:
            _give_up(error)
            return plain(env, files, piped)

    return start


def _give_up(error: WarmStartUnavailable) -> None:
    """Stop using the warm process for the rest of this process; say so once."""
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        logger.warning(
            "the warm worker process can't be used (%s); starting workers the plain way (set %s=0 to skip it)",
            error,
            ENV_WARM_START,
        )
    shutdown()
