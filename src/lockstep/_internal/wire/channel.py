"""The socket that carries :mod:`lockstep._internal.wire.protocol`'s messages, and who may open one.

The driver holds the run's secret (32 random bytes, never given to a worker). Each rank gets
only its own credential, ``HMAC-SHA256(secret, "lockstep rank <r>")`` (:func:`rank_credential`),
so a rank can prove that it is itself and nothing else. Opening a channel:

1. the worker says which rank it is: a ``Hello`` (its rank, pid and host name), unauthenticated;
2. the driver refuses a rank outside ``0 .. world_size - 1`` and a rank that has connected to
   this group already, and otherwise challenges the peer with that rank's credential
   (``multiprocessing.connection``'s HMAC challenge), then answers the peer's own challenge,
   so the worker knows it talks to the driver that made its credential;
3. from then on the connection *is* that rank: a message that claims another rank, or one that
   only the driver sends, closes it (:func:`check_sender`).

A peer gets :data:`HANDSHAKE_TIMEOUT_S` for all of that, so a silent one can't stall the driver.
The channel authenticates its ends; it does not encrypt (see the README's security section).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS
from lockstep._internal.wire import protocol
from lockstep._internal.wire.link_watch import watch_link

ENV_AUTHKEY = "LOCKSTEP_AUTHKEY"
"""The environment variable that holds a rank's own credential (hex)."""
ENV_DRIVER_PID = "LOCKSTEP_DRIVER_PID"
#: How long a connecting peer has to say hello and prove its credential.
HANDSHAKE_TIMEOUT_S = 10.0
#: The most bytes an unauthenticated peer may send in its Hello.
HELLO_MAX_BYTES = 4096


class ChannelRefused(ConnectionError):
    """The driver refused a peer (or a worker refused the driver); the message says why."""


def rank_credential(secret: bytes, rank: int) -> bytes:
    """Rank ``rank``'s credential: what it proves to the driver, derived from the run's secret."""
    return hmac.new(secret, f"lockstep rank {rank}".encode(), hashlib.sha256).digest()


def check_sender(rank: int, message: Any) -> str | None:
    """Why ``message``, read from rank ``rank``'s channel, can't be taken (None when it can):
    only the messages a worker sends, each naming the rank of its own connection."""
    if not isinstance(message, protocol.WORKER_MESSAGES) or isinstance(message, protocol.Hello):
        return f"rank {rank} sent a {type(message).__name__}, which a worker never sends on an open channel"
    claimed = message.failure.rank if isinstance(message, protocol.Failed) else message.rank
    if claimed != rank:
        return f"rank {rank} sent a {type(message).__name__} that claims to come from rank {claimed}"
    return None


class DriverListener:
    """A TCP listener on the driver that accepts the ranks of one worker group of ``world_size``."""

    def __init__(self, host: str, world_size: int) -> None:
        self.world_size = world_size
        self._secret = secrets.token_bytes(32)
        self._socket = socket.create_server((host, 0), backlog=128)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]

    @property
    def secret(self) -> bytes:
        """The run's secret, from which every rank's credential is derived (see :func:`rank_credential`)."""
        return self._secret

    def fileno(self) -> int:
        """Readable when a worker is waiting to be accepted (for ``multiprocessing.connection.wait``)."""
        return self._socket.fileno()

    def accept(self, refusal: Callable[[int], str | None]) -> tuple[Connection, protocol.Hello]:
        """Accept one waiting worker: read its Hello, ask ``refusal`` whether that rank may
        connect (a reason when not), and authenticate both ways with the rank's credential.

        Raises:
            ChannelRefused: the Hello names a rank outside the group, or ``refusal`` gave a reason.
            OSError, EOFError, multiprocessing.AuthenticationError, ValueError: the peer is not
                the rank it claims (wrong credential, not a Hello, too slow).
        """
        client, (peer, _) = self._socket.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        watch_link(client, sends_little=True)
        _set_receive_timeout(client, HANDSHAKE_TIMEOUT_S)
        connection = Connection(client.detach())
        try:
            hello = self._read_hello(connection, peer, refusal)
            credential = rank_credential(self._secret, hello.rank)
            deliver_challenge(connection, credential)
            answer_challenge(connection, credential)
        except BaseException:
            connection.close()
            raise
        with socket.socket(fileno=os.dup(connection.fileno())) as view:
            _set_receive_timeout(view, 0.0)
        return connection, hello

    def _read_hello(self, connection: Connection, peer: str, refusal: Callable[[int], str | None]) -> protocol.Hello:
        try:
            hello = protocol.decode(connection.recv_bytes(HELLO_MAX_BYTES))
        except ValueError as error:
            raise ValueError(f"{peer} sent something that is not a Hello ({error})") from error
        if not isinstance(hello, protocol.Hello) or not isinstance(hello.rank, int) or isinstance(hello.rank, bool):
            raise ValueError(f"{peer} sent a {type(hello).__name__} instead of a Hello with a rank")
        if not 0 <= hello.rank < self.world_size:
            raise ChannelRefused(f"{peer} claims rank {hello.rank}, but this group has ranks 0-{self.world_size - 1}")
        reason = refusal(hello.rank)
        if reason is not None:
            raise ChannelRefused(f"{peer} claims rank {hello.rank}, which {reason}")
        return hello

    def worker_env(self, rank: int) -> dict[str, str]:
        """The environment variables rank ``rank`` needs to connect back: the address and its own credential."""
        host, port = self.address
        return {
            ENV_DRIVER_ADDRESS: f"{host}:{port}",
            ENV_AUTHKEY: rank_credential(self._secret, rank).hex(),
            ENV_DRIVER_PID: str(os.getpid()),
        }

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
        data = protocol.encode(message)
        with self._send_lock:
            self._connection.send_bytes(data)

    def recv(self) -> Any:
        """Wait for the driver's next message."""
        return protocol.decode(self._connection.recv_bytes())

    def fileno(self) -> int:
        """The channel's socket."""
        return self._connection.fileno()

    def close(self) -> None:
        """Close the channel: the driver reads everything sent before, then the end of stream."""
        with self._send_lock:
            self._connection.close()


def connect_to_driver(rank: int, env: Mapping[str, str] = os.environ) -> WorkerChannel:
    """Open rank ``rank``'s channel to the driver named in ``env``, with the credential ``env`` holds.

    Raises:
        ChannelRefused: the driver refused this rank (another process connected as it already,
            or the credential is not this rank's), or the peer could not prove it is the driver.
        OSError: the driver can't be reached.
    """
    host, port = env[ENV_DRIVER_ADDRESS].rsplit(":", 1)
    credential = bytes.fromhex(env[ENV_AUTHKEY])
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    watch_link(sock, sends_little=False)
    connection = Connection(sock.detach())
    try:
        connection.send_bytes(protocol.encode(protocol.Hello(rank, os.getpid(), socket.gethostname())))
        answer_challenge(connection, credential)
        deliver_challenge(connection, credential)
    except (EOFError, OSError, ValueError, AuthenticationError) as error:
        connection.close()
        raise ChannelRefused(_refused_message(rank, host, port, error)) from error
    return WorkerChannel(connection)


def _refused_message(rank: int, host: str, port: str, error: BaseException) -> str:
    return (
        f"the driver at {host}:{port} refused rank {rank}'s channel, or could not prove it is the driver "
        f"({type(error).__name__}: {error or 'connection closed'}); another process may have connected as "
        f"rank {rank} already, or {ENV_AUTHKEY} is not this rank's credential"
    )


def _set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """Make blocking reads on ``sock``'s descriptor fail after ``seconds`` (0: never). Unlike
    ``settimeout``, this keeps the descriptor blocking, as ``Connection`` needs."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))
