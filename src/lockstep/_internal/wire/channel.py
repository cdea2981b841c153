"""The socket that carries :mod:`lockstep._internal.wire.protocol`'s messages, and who may open one.

The driver holds the run's secret (32 random bytes, never given to a worker). Each rank gets
only its own credential, ``HMAC-SHA256(secret, "lockstep rank <r>")`` (:func:`rank_credential`),
so a rank can prove that it is itself and nothing else. Opening a channel takes three messages,
each a frame of :mod:`lockstep._internal.wire.frames`:

1. the worker sends a ``Hello``: its rank, its pid, its host name and a fresh random nonce
   (unauthenticated, at most :data:`HELLO_MAX_BYTES`);
2. the driver refuses a rank outside ``0 .. world_size - 1`` and a rank that has connected to
   this group already (it closes the connection, having sent nothing); otherwise it answers
   with a ``Challenge``: a nonce of its own and its proof, an HMAC of both nonces under the
   rank's credential, so the worker knows it talks to the driver that made its credential;
3. the worker checks that proof and sends its own (``Proof``: an HMAC of both nonces under a
   different label, so one side's proof is never the other's).

From then on the connection *is* that rank: a message that claims another rank, or one that
only the driver sends, closes it (:func:`check_sender`). The driver never blocks on a peer: it
reads each opening channel as its bytes come (:class:`DriverHandshake`), and a peer gets
:data:`HANDSHAKE_TIMEOUT_S` for the whole exchange. The channel authenticates its ends; it does
not encrypt (see the security page of the docs).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS
from lockstep._internal.wire import codec, protocol
from lockstep._internal.wire.link_watch import watch_link
from lockstep.errors import WorkerFailure

ENV_AUTHKEY = "LOCKSTEP_AUTHKEY"
"""The environment variable that holds a rank's own credential (hex)."""
ENV_DRIVER_PID = "LOCKSTEP_DRIVER_PID"
#: How long a connecting peer has to say hello and prove its credential.
HANDSHAKE_TIMEOUT_S = 10.0
#: How long a rank waits for the driver to accept it and answer its Hello (a driver busy starting
#: many ranks answers within seconds; a listener that accepts and never answers must not hang it).
RANK_HANDSHAKE_WAIT_S = 60.0
#: The most bytes an unauthenticated peer may send in one frame (its Hello, its Proof).
HELLO_MAX_BYTES = 4096
NONCE_BYTES = 32
_DRIVER_LABEL = b"lockstep driver proof\0"
_RANK_LABEL = b"lockstep rank proof\0"


class ChannelRefused(ConnectionError):
    """The driver refused a peer (or a worker refused the driver); the message says why."""


def rank_credential(secret: bytes, rank: int) -> bytes:
    """Rank ``rank``'s credential: what it proves to the driver, derived from the run's secret."""
    return hmac.new(secret, f"lockstep rank {rank}".encode(), hashlib.sha256).digest()


def _proof(credential: bytes, label: bytes, first_nonce: bytes, second_nonce: bytes) -> str:
    return hmac.new(credential, label + first_nonce + second_nonce, hashlib.sha256).hexdigest()


def check_sender(rank: int, message: Any) -> str | None:
    """Why ``message``, read from rank ``rank``'s channel, can't be taken (None when it can):
    only the messages a worker sends, each naming the rank of its own connection."""
    if not isinstance(message, protocol.WORKER_MESSAGES) or isinstance(message, protocol.Hello):
        return f"rank {rank} sent a {type(message).__name__}, which a worker never sends on an open channel"
    if isinstance(message, protocol.Failed) and not isinstance(message.failure, WorkerFailure):
        return f"rank {rank} sent a Failed message without a failure"
    claimed = message.failure.rank if isinstance(message, protocol.Failed) else getattr(message, "rank", None)
    if claimed != rank:
        return f"rank {rank} sent a {type(message).__name__} that claims to come from rank {claimed}"
    return None


class DriverListener:
    """A TCP listener on the driver for the ranks of one worker group of ``world_size``; it never
    blocks (see :meth:`accept_waiting`)."""

    def __init__(self, host: str, world_size: int) -> None:
        self.world_size = world_size
        self._secret = secrets.token_bytes(32)
        self._socket = socket.create_server((host, 0), backlog=min(4096, max(128, world_size)))
        self._socket.setblocking(False)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]

    @property
    def secret(self) -> bytes:
        """The run's secret, from which every rank's credential is derived (see :func:`rank_credential`)."""
        return self._secret

    def fileno(self) -> int:
        """Readable when a worker is waiting to be accepted."""
        return self._socket.fileno()

    def accept_waiting(self) -> list[tuple[socket.socket, str]]:
        """Every connection waiting to be accepted (none may be), each with its peer's address:
        blocking sockets with the link watch on and no delay on small writes."""
        accepted: list[tuple[socket.socket, str]] = []
        while True:
            try:
                client, (peer, *_) = self._socket.accept()
            except (BlockingIOError, InterruptedError):
                return accepted
            except OSError:  # the peer gave up before we accepted it
                return accepted
            client.setblocking(True)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            watch_link(client, sends_little=True)
            accepted.append((client, str(peer)))

    def handshake(self, peer: str, refusal: Callable[[int], str | None]) -> DriverHandshake:
        """The driver's side of opening a channel with ``peer`` (see :class:`DriverHandshake`)."""
        return DriverHandshake(self, peer, refusal)

    def credential(self, rank: int) -> bytes:
        """Rank ``rank``'s credential."""
        return rank_credential(self._secret, rank)

    def worker_env(self, rank: int) -> dict[str, str]:
        """The environment variables rank ``rank`` needs to connect back: the address and its own credential."""
        host, port = self.address
        return {
            ENV_DRIVER_ADDRESS: f"{host}:{port}",
            ENV_AUTHKEY: self.credential(rank).hex(),
            ENV_DRIVER_PID: str(os.getpid()),
        }

    def close(self) -> None:
        """Stop accepting workers."""
        self._socket.close()


class DriverHandshake:
    """The driver's side of opening one channel, fed the peer's frames as they come: the Hello,
    then the Proof. ``refusal(rank)`` says why a rank may not connect now (None: it may).

    :meth:`on_frame` raises when the peer can't be the rank it claims:
    :class:`ChannelRefused` (a rank outside the group, or one ``refusal`` refuses) or
    ``ValueError`` (not a Hello, not a Proof, a wrong proof).
    """

    def __init__(self, listener: DriverListener, peer: str, refusal: Callable[[int], str | None]) -> None:
        self._listener = listener
        self.peer = peer
        self._refusal = refusal
        self.hello: protocol.Hello | None = None
        self._credential = b""
        self._nonces = (b"", b"")  # the worker's, the driver's

    def on_frame(self, payload: bytes) -> tuple[bytes | None, protocol.Hello | None]:
        """Take one frame from the peer: (what to send it back, the Hello once the peer has proven its rank)."""
        if self.hello is None:
            return self._on_hello(payload), None
        return None, self._on_proof(payload)

    def _on_hello(self, payload: bytes) -> bytes:
        hello = _decoded(payload, protocol.Hello, self.peer)
        if not isinstance(hello.rank, int) or isinstance(hello.rank, bool):
            raise ValueError(f"{self.peer} sent a Hello without a rank")
        world_size = self._listener.world_size
        if not 0 <= hello.rank < world_size:
            raise ChannelRefused(f"{self.peer} claims rank {hello.rank}, but this group has ranks 0-{world_size - 1}")
        reason = self._refusal(hello.rank)
        if reason is not None:
            raise ChannelRefused(f"{self.peer} claims rank {hello.rank}, which {reason}")
        worker_nonce = _nonce(hello.nonce, self.peer)
        driver_nonce = secrets.token_bytes(NONCE_BYTES)
        self.hello, self._nonces = hello, (worker_nonce, driver_nonce)
        self._credential = self._listener.credential(hello.rank)
        proof = _proof(self._credential, _DRIVER_LABEL, worker_nonce, driver_nonce)
        return codec.encode(protocol.Challenge(driver_nonce.hex(), proof))

    def _on_proof(self, payload: bytes) -> protocol.Hello:
        assert self.hello is not None
        answer = _decoded(payload, protocol.Proof, self.peer)
        worker_nonce, driver_nonce = self._nonces
        expected = _proof(self._credential, _RANK_LABEL, driver_nonce, worker_nonce)
        if not _same_proof(answer.proof, expected):
            raise ValueError(f"{self.peer} claims rank {self.hello.rank} but does not hold its credential")
        return self.hello


def _same_proof(given: Any, expected: str) -> bool:
    """Whether ``given`` (from the peer: anything) is ``expected``, compared in constant time."""
    return isinstance(given, str) and hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


def _decoded(payload: bytes, kind: type[Any], peer: str) -> Any:
    try:
        message = codec.decode(payload)
    except ValueError as error:
        raise ValueError(f"{peer} sent something that is not a {kind.__name__} ({error})") from error
    if not isinstance(message, kind):
        raise ValueError(f"{peer} sent a {type(message).__name__} instead of a {kind.__name__}")
    return message


def _nonce(text: Any, peer: str) -> bytes:
    try:
        nonce = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"{peer} sent a Hello without a {NONCE_BYTES}-byte nonce")
    return nonce


class WorkerChannel:
    """The worker's end of the channel: sends may come from two threads (the train function
    and the checkpoint upload thread), so they take a lock; only the train function receives."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        """Send one message to the driver."""
        data = codec.encode(message)
        with self._send_lock:
            self._connection.send_bytes(data)

    def recv(self) -> Any:
        """Wait for the driver's next message."""
        return codec.decode(self._connection.recv_bytes())

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
    sock = socket.create_connection((host, int(port)), timeout=RANK_HANDSHAKE_WAIT_S)
    sock.settimeout(None)  # blocking again: the timeout bounded the connect; the handshake polls
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    watch_link(sock, sends_little=False)
    connection = Connection(sock.detach())
    try:
        _prove_rank(connection, rank, credential)
    except (EOFError, OSError, ValueError) as error:
        connection.close()
        raise ChannelRefused(_refused_message(rank, host, port, error)) from error
    return WorkerChannel(connection)


def _prove_rank(connection: Connection, rank: int, credential: bytes) -> None:
    """The worker's side of opening a channel (see the module's docstring).

    Raises:
        ValueError: the peer is not the driver that made this credential.
        EOFError, OSError: the driver closed the connection (it refused this rank).
    """
    worker_nonce = secrets.token_bytes(NONCE_BYTES)
    connection.send_bytes(codec.encode(protocol.Hello(rank, os.getpid(), socket.gethostname(), worker_nonce.hex())))
    if not connection.poll(RANK_HANDSHAKE_WAIT_S):  # a listener that accepts and never answers
        raise TimeoutError(f"no answer to this rank's Hello within {RANK_HANDSHAKE_WAIT_S:g} s")
    challenge = codec.decode(connection.recv_bytes(HELLO_MAX_BYTES))
    if not isinstance(challenge, protocol.Challenge):
        raise ValueError(f"the driver sent a {type(challenge).__name__} instead of a Challenge")
    driver_nonce = _nonce(challenge.nonce, "the driver")
    expected = _proof(credential, _DRIVER_LABEL, worker_nonce, driver_nonce)
    if not _same_proof(challenge.proof, expected):
        raise ValueError("the peer could not prove it is the driver that made this rank's credential")
    connection.send_bytes(codec.encode(protocol.Proof(_proof(credential, _RANK_LABEL, driver_nonce, worker_nonce))))


def _refused_message(rank: int, host: str, port: str, error: BaseException) -> str:
    return (
        f"the driver at {host}:{port} refused rank {rank}'s channel, or could not prove it is the driver "
        f"({type(error).__name__}: {error or 'connection closed'}); another process may have connected as "
        f"rank {rank} already, or {ENV_AUTHKEY} is not this rank's credential"
    )
