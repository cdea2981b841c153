"""The driver's end of the workers' channels, the same for every executor: a listener that
accepts ranks as they connect, and one authenticated connection per rank."""

from __future__ import annotations

import logging
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

from lockstep._internal import protocol

logger = logging.getLogger(__name__)


class WorkerConnections:
    """Accepts workers on ``host``, reads what they send, and answers them."""

    def __init__(self, host: str) -> None:
        self.listener = protocol.DriverListener(host)
        self._by_rank: dict[int, Connection] = {}

    def worker_env(self) -> dict[str, str]:
        """The environment variables a worker needs to connect back."""
        return self.listener.worker_env()

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
            connection = self.listener.accept()
            hello = connection.recv()
        except (OSError, EOFError, AuthenticationError) as error:
            logger.warning("refused a connection that is not one of this run's workers: %s", error)
            return []
        self._by_rank[hello.rank] = connection
        return [hello]

    def _drain(self, connection: Connection) -> list[Any]:
        """Every message waiting on ``connection`` (it is dropped at end of stream)."""
        messages: list[Any] = []
        try:
            while connection.poll():
                messages.append(connection.recv())
        except (EOFError, OSError):
            self._forget(connection)
        return messages

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

    def _forget(self, connection: Connection) -> None:
        for rank, known in list(self._by_rank.items()):
            if known is connection:
                del self._by_rank[rank]
        connection.close()

    def send(self, rank: int, message: Any) -> None:
        """Send a message to a rank (ignored if that rank is already gone)."""
        connection = self._by_rank.get(rank)
        if connection is None:
            return
        try:
            connection.send(message)
        except OSError:
            self._forget(connection)

    def close(self) -> None:
        """Close every connection and the listener."""
        for connection in list(self._by_rank.values()):
            connection.close()
        self._by_rank.clear()
        self.listener.close()
