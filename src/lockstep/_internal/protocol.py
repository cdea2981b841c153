"""Messages between the driver and its workers, and the authenticated socket that carries them.

Every executor (local processes, Ray actors, torchrun's processes) uses this same channel: a
worker connects back to the driver, proves it knows the run's secret, says who it is
(``Hello``), is told where the attempt starts (``Start``), and then talks in the messages below.
(How the train function reaches a worker is the executor's business.)
The driver answers each ``Report`` only when every rank has sent it, which makes ``report()``
a barrier without any polling.

Messages travel as JSON, never as pickles: reading one can build nothing but the dataclasses
listed in ``MESSAGE_TYPES``, so a peer that got hold of the secret still can't run code on the
other end. (Under torchrun the secret travels through torch's rendezvous store, which has no
authentication of its own.)
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import secrets
import socket
import struct
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from lockstep._internal.link_watch import watch_link
from lockstep._internal.rank_env import ENV_DRIVER_ADDRESS
from lockstep._internal.step_timing import StepTimes
from lockstep._internal.storage import CheckpointEntry
from lockstep.errors import WorkerFailure

ENV_AUTHKEY = "LOCKSTEP_AUTHKEY"
ENV_DRIVER_PID = "LOCKSTEP_DRIVER_PID"
#: How long a connecting peer has to prove it knows the secret and say hello.
HANDSHAKE_TIMEOUT_S = 10.0


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
    ``external_path``); None when this rank passed no checkpoint. ``step_times``: where the
    rank's time since its previous report went (see :mod:`lockstep._internal.step_timing`).
    """

    rank: int
    index: int
    metrics_json: str | None
    checkpoint_dir_name: str | None = None
    checkpoint_state: str | None = None
    external_path: str | None = None
    step_times: StepTimes | None = None


@dataclass(frozen=True)
class WritingCheckpoint:
    """A rank is about to write files into checkpoint folder ``dir_name`` (so that the driver
    can remove the folder if the attempt fails before the checkpoint is committed)."""

    rank: int
    dir_name: str


@dataclass(frozen=True)
class CheckpointUploaded:
    """A rank's ASYNC upload for report ``index`` ended (``error`` says why it failed).
    ``external_path`` is set when a ``checkpoint_upload_fn`` put the checkpoint somewhere other
    than its folder in the run."""

    rank: int
    index: int
    dir_name: str
    error: str | None = None
    external_path: str | None = None


@dataclass(frozen=True)
class Collective:
    """A rank entered its collective number ``seq`` (``barrier`` or ``broadcast_from_rank_zero``,
    named in ``op``). Rank 0 of a broadcast sends its object pickled; the driver never unpickles
    it, it only hands the bytes on to the other ranks."""

    rank: int
    seq: int
    op: str
    data: bytes | None = None


@dataclass(frozen=True)
class CheckpointsQuery:
    """``get_all_reported_checkpoints()``: the rank wants the run's checkpoints once those of
    every report before ``before_index`` are committed."""

    rank: int
    before_index: int


@dataclass(frozen=True)
class Output:
    """Bytes a rank wrote to stdout or stderr (sent by executors whose workers' output doesn't
    reach the driver through a pipe, such as Ray actors on other nodes)."""

    rank: int
    is_stderr: bool
    data: bytes


@dataclass(frozen=True)
class PreemptionNotice:
    """A rank on ``host`` is being taken away: its process got SIGTERM (sent from a thread the
    rank's signal handler starts, at any time; ``urgent``: a second one, stop at once), or
    another ``cause`` (a Ray node drain, with Ray's deadline ``deadline_ms`` when it has one)."""

    rank: int
    host: str
    urgent: bool = False
    cause: str = "SIGTERM"
    deadline_ms: int | None = None


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
class Start:
    """The driver's answer to ``Hello``: where this attempt starts.

    Attributes:
        first_report_index: The index of the rank's first ``report()``.
        checkpoint: The run's latest committed checkpoint (its record entry), if it has one.
        from_resume_checkpoint: With no checkpoint of the run's own, whether to start from the
            trainer's ``resume_from_checkpoint``.
        used_dir_names: Checkpoint folder names the run has used already.
    """

    first_report_index: int
    checkpoint: CheckpointEntry | None = None
    from_resume_checkpoint: bool = False
    used_dir_names: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Preempted:
    """The run's preemption notice, as ranks learn it (the fields of ``lockstep.PreemptionInfo``)."""

    deadline_ms: int | None
    node_to_ranks: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportDone:
    """Every rank has made report ``index`` and it is recorded. ``new_latest_checkpoint`` is
    the newest committed checkpoint's record entry when it changed since the previous
    ReportDone, else None. ``preempted`` is the preemption notice once there is one; with
    ``stop``, the run stops here (preempted) and ``report()`` does not return."""

    index: int
    new_latest_checkpoint: CheckpointEntry | None = None
    preempted: Preempted | None = None
    stop: bool = False


@dataclass(frozen=True)
class CollectiveDone:
    """Every rank has entered collective ``seq``; ``data`` is rank 0's pickled object (broadcast)."""

    seq: int
    data: bytes | None = None


@dataclass(frozen=True)
class ReportedCheckpoints:
    """The answer to a :class:`CheckpointsQuery`: the run's kept checkpoints, with their metrics."""

    checkpoints: list[CheckpointEntry] = field(default_factory=list)


def checkpoint_ref(entry: CheckpointEntry | None) -> CheckpointEntry | None:
    """A record entry as ranks are told of it: what names the checkpoint, without its metrics."""
    return dataclasses.replace(entry, metrics={}) if entry is not None else None


# -- encoding ------------------------------------------------------------------------------------

MESSAGE_TYPES: dict[str, type] = {
    kind.__name__: kind
    for kind in (Hello, Report, WritingCheckpoint, CheckpointUploaded, Collective, CheckpointsQuery, Output,
                 PreemptionNotice, Finished, Failed, Start, Preempted, ReportDone, CollectiveDone, ReportedCheckpoints,
                 WorkerFailure, CheckpointEntry, StepTimes)
}
TYPE_KEY = "~type"
BYTES_KEY = "~bytes"


def encode(message: Any) -> bytes:
    """A message as JSON bytes."""
    return json.dumps(_plain(message), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The message that :func:`encode` made.

    Raises:
        ValueError: ``data`` is not such a message.
    """
    return _rebuilt(json.loads(data))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and type(value).__name__ in MESSAGE_TYPES:
        fields = {item.name: _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
        return {TYPE_KEY: type(value).__name__, **fields}
    if isinstance(value, bytes):
        return {BYTES_KEY: base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a {type(value).__name__} can't travel on lockstep's channel")


def _rebuilt(value: Any) -> Any:
    if isinstance(value, list):
        return [_rebuilt(item) for item in value]
    if not isinstance(value, dict):
        return value
    if BYTES_KEY in value:
        return base64.b64decode(value[BYTES_KEY])
    fields = {key: _rebuilt(item) for key, item in value.items() if key != TYPE_KEY}
    if TYPE_KEY not in value:
        return fields
    kind = MESSAGE_TYPES.get(value[TYPE_KEY])
    if kind is None:
        raise ValueError(f"unknown message type {value[TYPE_KEY]!r} on lockstep's channel")
    try:
        return kind(**fields)
    except TypeError as error:
        raise ValueError(f"a malformed {kind.__name__} on lockstep's channel: {error}") from error


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

    def accept(self) -> tuple[Connection, Hello]:
        """Accept one waiting worker, authenticate it both ways and read its Hello. A peer gets
        ``HANDSHAKE_TIMEOUT_S`` for all of that, so a silent one can't stall the driver.

        Raises:
            OSError, EOFError, multiprocessing.AuthenticationError, ValueError: the peer is not
                one of this run's workers (wrong or missing secret, not a Hello, too slow).
        """
        client, _ = self._socket.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        watch_link(client, sends_little=True)
        _set_receive_timeout(client, HANDSHAKE_TIMEOUT_S)
        connection = Connection(client.detach())
        try:
            deliver_challenge(connection, self.authkey)
            answer_challenge(connection, self.authkey)
            hello = decode(connection.recv_bytes())
            if not isinstance(hello, Hello):
                raise ValueError(f"expected a Hello, got {type(hello).__name__}")
        except BaseException:
            connection.close()
            raise
        with socket.socket(fileno=os.dup(connection.fileno())) as view:
            _set_receive_timeout(view, 0.0)
        return connection, hello

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
        data = encode(message)
        with self._send_lock:
            self._connection.send_bytes(data)

    def recv(self) -> Any:
        """Wait for the driver's next message."""
        return decode(self._connection.recv_bytes())

    def fileno(self) -> int:
        """The channel's socket."""
        return self._connection.fileno()

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
    watch_link(sock, sends_little=False)
    connection = Connection(sock.detach())
    answer_challenge(connection, authkey)
    deliver_challenge(connection, authkey)
    return WorkerChannel(connection)


def _set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """Make blocking reads on ``sock``'s descriptor fail after ``seconds`` (0: never). Unlike
    ``settimeout``, this keeps the descriptor blocking, as ``Connection`` needs."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))
