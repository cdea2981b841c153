"""File descriptors at many ranks: the driver holds a few per rank (its channel, its output
pipes, a process handle), so a group of a thousand ranks passes the common soft limit of 1,024
open files; and ``select.select`` can't watch a descriptor numbered 1,024 or more, so code that
may run in such a process waits with ``poll`` (:func:`readable_within`)."""

from __future__ import annotations

import logging
import resource
import select
from typing import Protocol

__all__ = ["DESCRIPTORS_PER_RANK", "ensure_descriptors_for", "readable_within"]

logger = logging.getLogger(__name__)

#: Descriptors the driver may hold per rank: its channel, stdout and stderr pipes, a pidfd.
DESCRIPTORS_PER_RANK = 4

#: Descriptors kept for everything else the driver opens (storage, logs, imports, Ray, ...).
_HEADROOM = 256


class HasFileno(Protocol):
    """Anything with a descriptor: a socket, a file, a pipe."""

    def fileno(self) -> int: ...


def readable_within(source: int | HasFileno, timeout_s: float | None) -> bool:
    """Whether ``source`` has something to read (or has hung up) within ``timeout_s`` seconds
    (None: wait as long as it takes); works for descriptors of any number, unlike select."""
    poller = select.poll()
    poller.register(source, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000))))


def ensure_descriptors_for(ranks: int) -> None:
    """Raise this process's soft limit on open files so that a group of ``ranks`` ranks fits
    (up to the hard limit; a warning says so when even that is too low)."""
    needed = ranks * DESCRIPTORS_PER_RANK + _HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.debug("open-file limit raised from %d to %d for %d ranks", soft, target, ranks)
    if target < needed:
        logger.warning(
            "%d ranks need about %d open files in the driver, but this process may open only %d (its hard "
            "limit): raise it (ulimit -Hn, or LimitNOFILE= for a service) or the run may fail with "
            "'Too many open files'.",
            ranks,
            needed,
            hard,
        )
