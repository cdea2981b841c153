"""Ray node drains as preemption notices.

When Ray is told that a node goes away (a spot VM's preemption, a drain asked with
``ray drain-node``), it marks the node as draining, with a deadline. Ray 2.60 shows that only
through a private call, ``ray._private.state.state.get_draining_nodes()`` (node id -> deadline in
ms, 0 for none), which Ray Train polls too. While a worker group is up, :class:`DrainWatcher`
polls it about once a second from a thread; when a node that holds ranks of the group starts
draining, it hands the controller one ``PreemptionNotice`` per rank there (the node's IP as the
host, "a Ray node drain" as the cause, and Ray's deadline, which shortens the grace when it comes
sooner), once per node, as a SIGTERM to those ranks would. Drains of other nodes are
ignored. If the private call is missing or fails, the watcher says so once (at debug level) and
stops: a run never fails because of it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from lockstep._internal.executors.ray_placement import RankPlace
from lockstep._internal.wire import protocol

logger = logging.getLogger(__name__)

#: Seconds between two looks at Ray's draining nodes.
POLL_INTERVAL_S = 1.0


def draining_nodes() -> dict[str, int]:
    """Ray's draining nodes: node id (hex) -> deadline (UNIX time in ms; 0: no deadline).

    Raises:
        Exception: whatever the private Ray call raises (AttributeError where it is missing).
    """
    import ray

    return dict(ray._private.state.state.get_draining_nodes() or {})


class DrainWatcher:
    """Watches Ray's node drains for one worker group, from its own thread.

    Args:
        places: Where the group's ranks run.
        wake: Called (from the watcher's thread) after notices are queued, so that the
            controller's wait returns.
        poll: What returns the draining nodes (:func:`draining_nodes`).
        interval_s: Seconds between two polls.
    """

    def __init__(
        self,
        places: Iterable[RankPlace],
        wake: Callable[[], object],
        poll: Callable[[], dict[str, int]] = draining_nodes,
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self._nodes: dict[str, tuple[str, list[int]]] = {}
        for rank in places:
            self._nodes.setdefault(rank.place.node_id, (rank.place.node_ip, []))[1].append(rank.world_rank)
        self._wake = wake
        self._poll = poll
        self._interval_s = interval_s
        self._noticed: set[str] = set()
        self._notices: queue.SimpleQueue[protocol.PreemptionNotice] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lockstep-ray-drains")
        self._thread.start()

    def take(self) -> list[protocol.PreemptionNotice]:
        """The notices queued since the last call."""
        notices = []
        while not self._notices.empty():
            notices.append(self._notices.get())
        return notices

    def stop(self) -> None:
        """Stop polling; returns once the thread has ended (it no longer calls ``wake``)."""
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        logger.debug("Watching Ray's node drains for %d node(s) every %.1f s.", len(self._nodes), self._interval_s)
        while not self._stopping.is_set():
            try:
                drained = self._poll()
            except Exception as error:  # noqa: BLE001 - a private Ray call: never fail the run over it
                logger.debug(
                    "Can't see Ray's node drains (%s: %s); they are not watched for this worker group.",
                    type(error).__name__,
                    error,
                )
                return
            if self._notice(drained):
                self._wake()
            self._stopping.wait(self._interval_s)

    def _notice(self, drained: dict[str, Any]) -> bool:
        """Queue the notices for the group's nodes that started draining; whether any came."""
        fresh = [node_id for node_id in drained if node_id in self._nodes and node_id not in self._noticed]
        for node_id in fresh:
            self._noticed.add(node_id)
            host, ranks = self._nodes[node_id]
            logger.warning(
                "Ray is draining node %s (%s), where rank(s) %s run (Ray's deadline: %s).",
                node_id[:8],
                host,
                ranks,
                _deadline_text(drained[node_id]),
            )
            deadline_ms = _deadline_ms(drained[node_id])
            for rank in ranks:
                self._notices.put(
                    protocol.PreemptionNotice(rank, host, cause="a Ray node drain", deadline_ms=deadline_ms)
                )
        return bool(fresh)


def _deadline_ms(deadline_ms: Any) -> int | None:
    """Ray's drain deadline in epoch milliseconds, or None when it has none."""
    try:
        deadline = int(deadline_ms)
    except (TypeError, ValueError):
        return None
    return deadline if deadline > 0 else None


def _deadline_text(deadline_ms: Any) -> str:
    """Ray's drain deadline, as seconds from now."""
    try:
        deadline = int(deadline_ms)
    except (TypeError, ValueError):
        return "unknown"
    if deadline <= 0:
        return "none"
    return f"in {max(0.0, deadline / 1000 - time.time()):.0f} s"
