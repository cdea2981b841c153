"""Messages between the driver and its workers, and the authenticated socket that carries them.

Every executor (local processes, Ray actors, …) uses this same channel: a worker connects
back to the driver, says who it is, and then talks in the messages below. (How the payload
reaches a worker is the executor's business.)
The driver answers each ``Report`` only when every rank has sent it, which makes ``report()``
a barrier without any polling.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from lockstep.errors import WorkerFailure

ENV_DRIVER_ADDRESS = "LOCKSTEP_DRIVER_ADDRESS"
ENV_AUTHKEY = "LOCKSTEP_AUTHKEY"
ENV_DRIVER_PID = "LOCKSTEP_DRIVER_PID"


# -- worker -> driver ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """First message of a worker: its rank and process id."""

    rank: int
    pid: int


@dataclass(frozen=True)
class Report:
    """One rank's ``report()`` call. Only rank 0 sends metrics (as a JSON string).

    ``checkpoint_state`` says where this rank's checkpoint files are: ``"written"`` (in the
    checkpoint folder already), ``"uploading"`` (an ASYNC upload follows with
    :class:`CheckpointUploaded`) or ``"external"`` (NO_UPLOAD: registered where it is, at
    ``external_path``); None when this rank passed no checkpoint.
    """

    rank: int
    index: int
    metrics_json: str | None
    checkpoint_dir_name: str | None = None
    checkpoint_state: str | None = None
    external_path: str | None = None


@dataclass(frozen=True)
class WritingCheckpoint:
    """A rank is about to write files into checkpoint folder ``dir_name`` (so that the driver
    can remove the folder if the attempt fails before the checkpoint is committed)."""

    rank: int
    dir_name: str


@dataclass(frozen=True)
class CheckpointUploaded:
    """A rank's ASYNC upload for report ``index`` ended (``error`` says why it failed)."""

    rank: int
    index: int
    dir_name: str
    error: str | None = None


@dataclass(frozen=True)
class Output:
    """Bytes a rank wrote to stdout or stderr (sent by executors whose workers' output doesn't
    reach the driver through a pipe, such as Ray actors on other nodes)."""

    rank: int
    is_stderr: bool
    data: bytes


@dataclass(frozen=True)
class Finished:
    """The train function returned; rank 0 sends its pickled return value."""

    rank: int
    return_value: bytes | None


@dataclass(frozen=True)
class Failed:
    """The train function (or the worker's set-up) raised."""

    failure: WorkerFailure


# -- driver -> worker ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportDone:
    """Every rank has made report ``index`` and it is recorded. ``new_latest_checkpoint`` is
    the newest committed checkpoint when it changed since the previous ReportDone, else None."""

    index: int
    new_latest_checkpoint: Any = None


# -- the channel ---------------------------------------------------------------------------------


class DriverListener:
    """A TCP listener on the driver that accepts workers and checks their shared secret."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.authkey = secrets.token_bytes(32)
        self._socket = socket.create_server((host, 0), backlog=128)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]

    def fileno(self) -> int:
        """Readable when a worker is waiting to be accepted (for ``multiprocessing.connection.wait``)."""
        return self._socket.fileno()

    def accept(self) -> Connection:
        """Accept one waiting worker and authenticate it both ways."""
        client, _ = self._socket.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = Connection(client.detach())
        deliver_challenge(connection, self.authkey)
        answer_challenge(connection, self.authkey)
        return connection

    def worker_env(self) -> dict[str, str]:
        """The environment variables a worker needs to connect back."""
        host, port = self.address
        return {ENV_DRIVER_ADDRESS: f"{host}:{port}", ENV_AUTHKEY: self.authkey.hex(), ENV_DRIVER_PID: str(os.getpid())}

    def close(self) -> None:
        """Stop accepting workers."""
        self._socket.close()


class WorkerChannel:
    """The worker's end of the channel: sends may come from two threads (the train function
    and the checkpoint upload thread), so they take a lock; only the train function receives."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        """Send one message to the driver."""
        with self._send_lock:
            self._connection.send(message)

    def recv(self) -> Any:
        """Wait for the driver's next message."""
        return self._connection.recv()

    def close(self) -> None:
        """Close the channel: the driver reads everything sent before, then the end of stream."""
        with self._send_lock:
            self._connection.close()


def connect_to_driver(env: dict[str, str] | os._Environ[str] = os.environ) -> WorkerChannel:
    """Open the worker's channel to the driver named in its environment."""
    host, port = env[ENV_DRIVER_ADDRESS].rsplit(":", 1)
    authkey = bytes.fromhex(env[ENV_AUTHKEY])
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    connection = Connection(sock.detach())
    answer_challenge(connection, authkey)
    deliver_challenge(connection, authkey)
    return WorkerChannel(connection)

