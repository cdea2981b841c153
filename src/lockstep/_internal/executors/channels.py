"""The driver's end of the workers' channels, the same for every executor: a listener that
accepts ranks as they connect, one authenticated connection per rank (each rank once per
group), and the part of a worker group that only talks over them (:class:`ChannelGroup`).
Every message read from a connection is checked to come from that connection's rank
(:func:`lockstep._internal.wire.channel.check_sender`)."""

from __future__ import annotations

import logging
import os
import socket
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, wait
from typing import Any

from lockstep._internal.output.worker_output import ConsoleMode, OutputRelay
from lockstep._internal.run.failures import FailureKind
from lockstep._internal.run.worker_group import WorkerExited, WorkerGroup
from lockstep._internal.wire import channel, protocol
from lockstep._internal.wire.link_watch import LOST_EXIT_CODE, lost_link_cause

logger = logging.getLogger(__name__)


class WorkerConnections:
    """Accepts the ``world_size`` ranks of one group on ``host``, reads what they send, and answers them."""

    def __init__(self, host: str, world_size: int) -> None:
        self.listener = channel.DriverListener(host, world_size)
        self._by_rank: dict[int, Connection] = {}
        self._rank_of: dict[int, int] = {}  # id(connection) -> rank
        self._peers: dict[int, str] = {}  # every rank that connected to this group, and its host
        self._lost: dict[int, str] = {}

    def worker_env(self, rank: int) -> dict[str, str]:
        """The environment variables rank ``rank`` needs to connect back (with its own credential)."""
        return self.listener.worker_env(rank)

    def connected_ranks(self) -> set[int]:
        """The ranks whose channel is open."""
        return set(self._by_rank)

    def waitables(self) -> list[Any]:
        """What ``multiprocessing.connection.wait`` should watch: the listener and every connection."""
        return [self.listener, *self._by_rank.values()]

    def owns(self, ready: Any) -> bool:
        """Whether ``ready`` (returned by ``wait``) is one of these channels."""
        return ready is self.listener or isinstance(ready, Connection)

    def read(self, ready: Any) -> list[Any]:
        """The messages available on ``ready``: a new worker's Hello, or what a worker sent."""
        return self._accept() if ready is self.listener else self._drain(ready)

    def _accept(self) -> list[Any]:
        try:
            connection, hello = self.listener.accept(self._refusal)
        except (OSError, EOFError, AuthenticationError, ValueError) as error:
            logger.warning(
                "refused a connection that is not one of this run's workers: %s", error or type(error).__name__
            )
            return []
        self._by_rank[hello.rank] = connection
        self._rank_of[id(connection)] = hello.rank
        self._peers[hello.rank] = _peer_host(connection)
        return [hello]

    def _refusal(self, rank: int) -> str | None:
        """Why ``rank`` may not connect now (None: it may): each rank connects once per group."""
        return "has connected to this group already" if rank in self._peers else None

    def _drain(self, connection: Connection) -> list[Any]:
        """Every message waiting on ``connection`` (it is dropped at end of stream, and at a
        message its rank may not send: then a ChannelViolation failure of that rank ends the list)."""
        rank = self._rank_of[id(connection)]
        messages: list[Any] = []
        try:
            while connection.poll():
                message = protocol.decode(connection.recv_bytes())
                violation = channel.check_sender(rank, message)
                if violation is not None:
                    return [*messages, self._violated(connection, rank, violation)]
                messages.append(message)
        except (EOFError, OSError, ValueError) as error:
            self._forget(connection, error)
        return messages

    def _violated(self, connection: Connection, rank: int, violation: str) -> protocol.Failed:
        """Close rank ``rank``'s channel for ``violation``; the failure that says so."""
        logger.warning("closed rank %d's channel: %s", rank, violation)
        self._forget(connection)
        return protocol.Failed(
            FailureKind.CHANNEL_VIOLATION.failure(
                rank,
                f"{violation}; lockstep closed its channel (a message's rank is the rank of the channel it "
                "comes on, and nothing it carries was unpickled)",
            )
        )

    def drain_rank(self, rank: int, until_closed_s: float = 0.0) -> list[Any]:
        """What ``rank`` sent and is not read yet. With ``until_closed_s``, keep reading until the
        worker closes its end (or that many seconds pass): its last messages may still be on
        the way when the executor learns that it ended."""
        connection = self._by_rank.get(rank)
        if connection is None:
            return []
        messages = self._drain(connection)
        deadline = time.monotonic() + until_closed_s
        while rank in self._by_rank and connection.poll(max(0.0, deadline - time.monotonic())):
            messages += self._drain(connection)
        return messages

    def _forget(self, connection: Connection, error: BaseException | None = None) -> None:
        self._rank_of.pop(id(connection), None)
        for rank, known in list(self._by_rank.items()):
            if known is connection:
                del self._by_rank[rank]
                cause = lost_link_cause(error, self._peers.get(rank, "?")) if error is not None else None
                if cause is not None:
                    logger.warning("rank %d's channel is %s", rank, cause)
                    self._lost[rank] = cause
        connection.close()

    def peer_host(self, rank: int) -> str:
        """The address ``rank`` connected from ("?" when it never connected)."""
        return self._peers.get(rank, "?")

    def take_lost(self) -> dict[int, str]:
        """The ranks whose host stopped answering since the last call, each with what to say
        of it (see :mod:`lockstep._internal.wire.link_watch`)."""
        lost, self._lost = self._lost, {}
        return lost

    def send(self, rank: int, message: Any) -> None:
        """Send a message to a rank (ignored if that rank is already gone)."""
        connection = self._by_rank.get(rank)
        if connection is None:
            return
        try:
            connection.send_bytes(protocol.encode(message))
        except OSError as error:
            self._forget(connection, error)

    def close(self) -> None:
        """Close every connection and the listener."""
        for connection in list(self._by_rank.values()):
            connection.close()
        self._by_rank.clear()
        self._rank_of.clear()
        self.listener.close()


class ChannelGroup(WorkerGroup):
    """The part of a worker group that talks to its ranks: their channels (listening on
    ``host``, for ``world_size`` ranks) and, with a ``log_dir``, the relay of their output to log
    files and the console."""

    def __init__(self, host: str, world_size: int, log_dir: str | None = None, console: ConsoleMode = "rank0") -> None:
        self._channels = WorkerConnections(host, world_size)
        self._output = OutputRelay(log_dir, console) if log_dir else None

    def _wait(self, others: list[Any], timeout: float | None) -> tuple[list[Any], list[Any]]:
        """Wait on the channels and ``others`` together; return the ranks' messages (their
        output already relayed) and which of ``others`` are ready."""
        events: list[Any] = []
        ready_others: list[Any] = []
        for ready in wait([*self._channels.waitables(), *others], timeout):
            if self._channels.owns(ready):
                events += self._channels.read(ready)
            else:
                ready_others.append(ready)
        lost = [WorkerExited(rank, LOST_EXIT_CODE, cause) for rank, cause in self._channels.take_lost().items()]
        return [*self._relayed(events), *lost], ready_others

    def _relayed(self, events: list[Any]) -> list[Any]:
        """Hand the ranks' Output messages to the relay; return the other events. (A Hello
        tells the relay which ranks to expect lines from.)"""
        others = []
        for event in events:
            if not isinstance(event, protocol.Output):
                others.append(event)
                if isinstance(event, protocol.Hello) and self._output is not None:
                    self._output.expect(event.rank)
            elif self._output is not None:
                self._output.write(event.rank, event.data, event.is_stderr)
        return others

    @property
    def listener(self) -> channel.DriverListener:
        """Where the ranks connect, and the secret they must know."""
        return self._channels.listener

    def send(self, rank: int, message: Any) -> None:
        """Send a message to a rank (ignored if that rank is already gone)."""
        self._channels.send(rank, message)

    def output_tail(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr, and where its full log is."""
        return self._output.tail_with_log_path(rank) if self._output is not None else ""

    def _close_channels(self) -> None:
        self._channels.close()
        if self._output is not None:
            self._output.close()


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
        events, _ = self._wait([], timeout)
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


def _peer_host(connection: Connection) -> str:
    """The address of the host at the other end of ``connection``."""
    try:
        with socket.socket(fileno=os.dup(connection.fileno())) as view:
            return str(view.getpeername()[0])
    except OSError:
        return "?"
