"""Descriptors watched for reading with one ``epoll``: the driver's event loop over its ranks'
connections (:mod:`lockstep._internal.executors.channels`).

``selectors.EpollSelector`` does the same with a key object per descriptor and a tuple per event;
at 1,024 ranks that bookkeeping was a tenth of the driver's CPU per report round
(docs/scaling.md). Here a readable descriptor hands back the object it was added with, nothing
else.
"""

from __future__ import annotations

import contextlib
import select
from typing import Any

__all__ = ["ReadySet"]


class ReadySet:
    """Descriptors (or objects with ``fileno()``), each with the object :meth:`ready` hands back
    when it is readable, closed, or in error."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._targets: dict[int, Any] = {}
        self._handles: dict[int, Any] = {}

    def add(self, handle: Any, target: Any) -> None:
        """Watch ``handle``; :meth:`ready` gives ``target`` when it is readable.

        Raises:
            KeyError: ``handle`` is watched already.
        """
        descriptor = _descriptor(handle)
        if descriptor in self._targets:
            raise KeyError(f"descriptor {descriptor} is watched already")
        self._epoll.register(descriptor, select.EPOLLIN)
        self._targets[descriptor] = target
        self._handles[descriptor] = handle

    def remove(self, handle: Any) -> None:
        """Stop watching ``handle`` (also when it was closed already)."""
        descriptor = _descriptor(handle)
        if descriptor < 0:  # a closed socket: find the descriptor it had
            descriptor = next((known for known, added in self._handles.items() if added is handle), -1)
        self._targets.pop(descriptor, None)
        self._handles.pop(descriptor, None)
        with contextlib.suppress(OSError):  # closed already: the kernel dropped it from the set
            self._epoll.unregister(descriptor)

    def ready(self, timeout: float | None) -> list[Any]:
        """The targets of the watched handles that are ready, waiting up to ``timeout`` seconds
        for one (None: without limit)."""
        events = self._epoll.poll(-1 if timeout is None else timeout, max(len(self._targets), 1))
        targets = self._targets
        return [targets[descriptor] for descriptor, _ in events if descriptor in targets]

    def close(self) -> None:
        """Release the ``epoll`` descriptor."""
        self._epoll.close()


def _descriptor(handle: Any) -> int:
    return handle if isinstance(handle, int) else int(handle.fileno())
