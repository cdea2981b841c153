"""A worker group of ranks that something else started (torchrun's processes, or the driver's
own process in local mode): the driver only talks to them over their channels."""

from __future__ import annotations

from typing import Any

from lockstep._internal.executors.channels import ChannelGroup
from lockstep._internal.run.worker_group import WorkerExited
from lockstep._internal.wire import protocol


class AttachedGroup(ChannelGroup):
    """Ranks that something else started (torchrun's processes, or this very process in local
    mode), as the controller sees them: it starts and stops nothing; a rank whose channel
    closes has ended (``exit_cause`` says so, with the rank's host when ``name_hosts``). Rank 0's
    return value is handed over in this process, never read from the network."""

    def __init__(self, host: str, world_size: int, exit_cause: str, name_hosts: bool = False) -> None:
        super().__init__(host, world_size)
        self.exit_cause = exit_cause
        self.name_hosts = name_hosts
        self._seen: set[int] = set()
        self._ended: set[int] = set()
        self._return_value: Any = None

    def start(self) -> None:
        """Nothing to start: the ranks are already running."""

    def wait_events(self, timeout: float | None) -> list[Any]:
        """What the ranks sent; a WorkerExited for each rank whose channel has closed."""
        events, _ = self._wait(timeout)
        self._seen |= {event.rank for event in events if isinstance(event, protocol.Hello)}
        self._ended |= {event.rank for event in events if isinstance(event, WorkerExited)}
        for rank in sorted(self._seen - self._ended - self._channels.connected_ranks()):
            self._ended.add(rank)
            host = f" (host {self._channels.peer_host(rank)})" if self.name_hosts else ""
            events.append(WorkerExited(rank, 0, self.exit_cause + host))
        return events

    def keep_return_value(self, value: Any) -> None:
        """Rank 0's train function returned ``value`` (called in this process)."""
        self._return_value = value

    def return_value(self, finished: protocol.Finished) -> Any:
        """Rank 0's return value as this process kept it."""
        return self._return_value

    def stop(self) -> None:
        """Close the channels: ranks waiting in ``report()`` then fail."""
        self._close_channels()
