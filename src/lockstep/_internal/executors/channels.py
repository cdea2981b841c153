"""The driver's end of the workers' channels, the same for every executor: a listener that
accepts ranks as they connect, one authenticated connection per rank (each rank once per
group), and the part of a worker group that only talks over them (:class:`ChannelGroup`).
Every message read from a connection is checked to come from that connection's rank
(:func:`lockstep._internal.wire.channel.check_sender`).

One event loop serves a whole group: the listener, every connection (opening or open) and
whatever else the executor watches (process handles, a wake-up pipe) are registered once with
one ``epoll`` (:class:`~lockstep._internal.executors.ready_set.ReadySet`), so a wait costs the
same with 2 ranks as with 1,000, and nothing the driver reads ever blocks it: an opening
connection is read as its bytes come (:class:`~lockstep._internal.wire.channel.DriverHandshake`),
and an answer every rank gets is encoded once.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.descriptors import ensure_descriptors_for
from lockstep._internal.executors.ready_set import ReadySet
from lockstep._internal.output.worker_output import ConsoleMode, OutputRelay
from lockstep._internal.run.failures import FailureKind
from lockstep._internal.run.worker_group import WorkerExited, WorkerGroup
from lockstep._internal.wire import channel, codec, protocol
from lockstep._internal.wire.frames import FrameReader, frame
from lockstep._internal.wire.link_watch import LOST_EXIT_CODE, lost_link_cause

logger = logging.getLogger(__name__)

READ_CHUNK = 1 << 18


@dataclass(eq=False)
class _Peer:
    """One accepted connection: opening (``handshake`` set) or open as ``rank``."""

    sock: socket.socket
    host: str
    handshake: channel.DriverHandshake | None
    deadline: float
    reader: FrameReader = field(default_factory=lambda: FrameReader(channel.HELLO_MAX_BYTES))
    rank: int | None = None


@dataclass(frozen=True)
class _Watched:
    """Something else the group's wait watches (a process handle, a pipe): its ``tag`` is handed
    back when it is ready."""

    tag: Any


class WorkerConnections:
    """Accepts the ``world_size`` ranks of one group on ``host``, reads what they send, and answers them."""

    def __init__(self, host: str, world_size: int) -> None:
        ensure_descriptors_for(world_size)
        self.listener = channel.DriverListener(host, world_size)
        self._ready = ReadySet()
        self._ready.add(self.listener.fileno(), self.listener)
        self._opening: set[_Peer] = set()
        self._by_rank: dict[int, _Peer] = {}
        self._peers: dict[int, str] = {}  # every rank that connected to this group, and its host
        self._lost: dict[int, str] = {}

    def worker_env(self, rank: int) -> dict[str, str]:
        """The environment variables rank ``rank`` needs to connect back (with its own credential)."""
        return self.listener.worker_env(rank)

    def connected_ranks(self) -> set[int]:
        """The ranks whose channel is open."""
        return set(self._by_rank)

    # -- waiting -------------------------------------------------------------------------------

    def watch(self, handle: Any, tag: Any = None) -> None:
        """Wake :meth:`wait` when ``handle`` (a descriptor or an object with ``fileno()``) is
        readable; :meth:`wait` then hands back ``tag`` (``handle`` itself if None)."""
        self._ready.add(handle, _Watched(handle if tag is None else tag))

    def unwatch(self, handle: Any) -> None:
        """Stop watching ``handle`` (before it is closed)."""
        self._ready.remove(handle)

    def wait(self, timeout: float | None) -> tuple[list[Any], list[Any]]:
        """Wait until a rank sends something, a peer connects or a watched handle is ready (or
        ``timeout`` passes); return (the ranks' messages, Hellos of newly proven ranks first
        in their turn, and the tags of the watched handles that are ready)."""
        events: list[Any] = []
        ready_handles: list[Any] = []
        for target in self._ready.ready(self._bounded(timeout)):
            if isinstance(target, _Watched):
                ready_handles.append(target.tag)
            elif target is self.listener:
                self._accept()
            else:
                events += self._read(target)
        self._drop_silent_peers()
        return events, ready_handles

    def _bounded(self, timeout: float | None) -> float | None:
        """``timeout``, cut short so that an opening peer that went silent is dropped on time."""
        if not self._opening:
            return timeout
        first = max(0.0, min(peer.deadline for peer in self._opening) - time.monotonic())
        return first if timeout is None else min(timeout, first)

    def _accept(self) -> None:
        deadline = time.monotonic() + channel.HANDSHAKE_TIMEOUT_S
        for sock, host in self.listener.accept_waiting():
            peer = _Peer(sock, host, self.listener.handshake(host, self._refusal), deadline)
            self._opening.add(peer)
            self._ready.add(sock, peer)

    def _refusal(self, rank: int) -> str | None:
        """Why ``rank`` may not connect now (None: it may): each rank connects once per group."""
        return "has connected to this group already" if rank in self._peers else None

    def _drop_silent_peers(self) -> None:
        now = time.monotonic()
        for peer in [peer for peer in self._opening if peer.deadline <= now]:
            self._refuse(peer, f"{peer.host} did not prove a rank within {channel.HANDSHAKE_TIMEOUT_S:g} s")

    def _refuse(self, peer: _Peer, reason: str) -> None:
        logger.warning("refused a connection that is not one of this run's workers: %s", reason)
        self._close(peer)

    # -- reading ---------------------------------------------------------------------------------

    def _read(self, peer: _Peer) -> list[Any]:
        """What ``peer`` sent that can be read now (nothing blocks)."""
        try:
            data = peer.sock.recv(READ_CHUNK)
        except OSError as error:
            return self._gone(peer, error)
        if not data:
            return self._gone(peer, None)
        if peer.handshake is not None:
            return self._opening_frames(peer, data)
        return self._messages(peer, peer.reader.feed(data))

    def _opening_frames(self, peer: _Peer, data: bytes) -> list[Any]:
        """Feed an opening channel; once its rank is proven, it is open and its Hello is the event."""
        assert peer.handshake is not None
        try:
            frames = peer.reader.feed(data)
            while frames and peer.handshake is not None:
                reply, proven = peer.handshake.on_frame(frames.pop(0))
                if reply is not None:
                    peer.sock.sendall(frame(reply))
                if proven is not None:
                    self._open(peer, proven)
                    return [proven, *self._messages(peer, frames)]
        except Exception as error:  # noqa: BLE001 - whatever an unproven peer sends can't end the run
            self._refuse(peer, str(error) or type(error).__name__)  # ChannelRefused, ValueError, ...
        return []

    def _open(self, peer: _Peer, hello: protocol.Hello) -> None:
        reason = self._refusal(hello.rank)  # two handshakes for one rank may overlap: the first one to prove wins
        if reason is not None:
            raise channel.ChannelRefused(f"{peer.host} proved rank {hello.rank}, which {reason}")
        self._opening.discard(peer)
        peer.handshake, peer.rank = None, hello.rank
        peer.reader.max_frame = None
        self._by_rank[hello.rank] = peer
        self._peers[hello.rank] = peer.host

    def _messages(self, peer: _Peer, frames: Iterable[bytes]) -> list[Any]:
        """The messages in ``frames`` from an open channel; at one its rank may not send, a
        ChannelViolation failure of that rank ends the list and the channel."""
        rank = peer.rank
        assert rank is not None
        messages: list[Any] = []
        for payload in frames:
            try:
                message = codec.decode(payload)
            except ValueError as error:
                return [*messages, self._violated(peer, f"rank {rank} sent something lockstep can't read ({error})")]
            violation = channel.check_sender(rank, message)
            if violation is not None:
                return [*messages, self._violated(peer, violation)]
            messages.append(message)
        return messages

    def _violated(self, peer: _Peer, violation: str) -> protocol.Failed:
        """Close ``peer``'s channel for ``violation``; the failure that says so."""
        assert peer.rank is not None
        logger.warning("closed rank %d's channel: %s", peer.rank, violation)
        self._close(peer)
        return protocol.Failed(
            FailureKind.CHANNEL_VIOLATION.failure(
                peer.rank,
                f"{violation}; lockstep closed its channel (a message's rank is the rank of the channel it "
                "comes on, and nothing it carries was unpickled)",
            )
        )

    def _gone(self, peer: _Peer, error: OSError | None) -> list[Any]:
        """``peer``'s connection ended (``error``: how, when it failed); a host that stopped
        answering is noted as lost."""
        if peer.rank is not None and error is not None:
            cause = lost_link_cause(error, peer.host)
            if cause is not None:
                logger.warning("rank %d's channel is %s", peer.rank, cause)
                self._lost[peer.rank] = cause
        self._close(peer)
        return []

    def _close(self, peer: _Peer) -> None:
        self._opening.discard(peer)
        if peer.rank is not None and self._by_rank.get(peer.rank) is peer:
            del self._by_rank[peer.rank]
        with contextlib.suppress(KeyError, ValueError):  # not registered (any more)
            self._ready.remove(peer.sock)
        peer.sock.close()

    def drain_rank(self, rank: int, until_closed_s: float = 0.0) -> list[Any]:
        """What ``rank`` sent and is not read yet. With ``until_closed_s``, keep reading until the
        worker closes its end (or that many seconds pass): its last messages may still be on
        the way when the executor learns that it ended."""
        peer = self._by_rank.get(rank)
        if peer is None:
            return []
        messages: list[Any] = []
        deadline = time.monotonic() + until_closed_s
        poller = select.poll()
        poller.register(peer.sock, select.POLLIN)
        while self._by_rank.get(rank) is peer:
            if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                break
            messages += self._read(peer)
        return messages

    def peer_host(self, rank: int) -> str:
        """The address ``rank`` connected from ("?" when it never connected)."""
        return self._peers.get(rank, "?")

    def take_lost(self) -> dict[int, str]:
        """The ranks whose host stopped answering since the last call, each with what to say
        of it (see :mod:`lockstep._internal.wire.link_watch`)."""
        lost, self._lost = self._lost, {}
        return lost

    # -- answering -----------------------------------------------------------------------------

    def send(self, rank: int, message: Any) -> None:
        """Send a message to a rank (ignored if that rank is already gone)."""
        peer = self._by_rank.get(rank)
        if peer is not None:
            self._send_frame(peer, frame(codec.encode(message)))

    def send_all(self, message: Any) -> None:
        """Send one message to every connected rank, encoded once."""
        data = frame(codec.encode(message))
        for peer in list(self._by_rank.values()):
            self._send_frame(peer, data)

    def _send_frame(self, peer: _Peer, data: bytes) -> None:
        try:
            peer.sock.sendall(data)
        except OSError as error:
            self._gone(peer, error)

    def close(self) -> None:
        """Close every connection and the listener."""
        for peer in [*self._by_rank.values(), *self._opening]:
            self._close(peer)
        self._ready.close()
        self.listener.close()


class ChannelGroup(WorkerGroup):
    """The part of a worker group that talks to its ranks: their channels (listening on
    ``host``, for ``world_size`` ranks) and, with a ``log_dir``, the relay of their output to log
    files and the console."""

    def __init__(self, host: str, world_size: int, log_dir: str | None = None, console: ConsoleMode = "rank0") -> None:
        self._channels = WorkerConnections(host, world_size)
        self._output = OutputRelay(log_dir, console) if log_dir else None

    def _wait(self, timeout: float | None) -> tuple[list[Any], list[Any]]:
        """Wait on the channels and the handles this group watches together; return the ranks'
        messages (their output already relayed) and the tags of the watched handles that are ready."""
        events, ready = self._channels.wait(timeout)
        lost = [WorkerExited(rank, LOST_EXIT_CODE, cause) for rank, cause in self._channels.take_lost().items()]
        return [*self._relayed(events), *lost], ready

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

    def send_all(self, message: Any, ranks: range) -> None:
        """Send one message to every rank (``ranks``: all of them), encoded once."""
        self._channels.send_all(message)

    def output_tail(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr, and where its full log is."""
        return self._output.tail_with_log_path(rank) if self._output is not None else ""

    def _close_channels(self) -> None:
        self._channels.close()
        if self._output is not None:
            self._output.close()
