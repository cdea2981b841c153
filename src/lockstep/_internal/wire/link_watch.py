"""Lost hosts: noticing that the other end of a channel is gone when nothing says so.

The channel between the driver and a rank is a TCP connection. When a rank's process dies, its
kernel closes the connection and the driver learns it at once. When the network to the rank's
host is cut, or the machine itself goes away, nothing arrives at all: no reset, no end of
stream, and a rank waiting in a collective for a peer on that host waits for the process
group's timeout (30 minutes by default). So:

- every channel socket has TCP keepalive, and the driver's end a user timeout too
  (:func:`watch_link`): the kernel gives the connection up after :data:`LINK_TIMEOUT_S` without
  an answer from the other end. A busy or stopped *process* keeps answering (its kernel does),
  so only a lost host or a cut network trips it;
- the driver then fails the rank as lost, naming its host (:func:`lost_link_cause`);
- a rank whose channel to the driver is lost while its train function is stuck (typically in
  a collective waiting for a rank on the lost host) ends its own process after
  :data:`STUCK_GRACE_S` (:class:`DriverWatch`): a thread can't interrupt a blocked collective.
  Keepalive probes only go out on an idle connection, and a rank's progress thread sends now
  and then: data waiting in the send queue (sent and unacknowledged, or not sendable at all
  while the interface is down) stops them. So the watch also reads the kernel's counters and
  counts the link lost when data has waited in the send queue, and nothing at all came back
  from the driver's kernel, for :data:`LINK_TIMEOUT_S` (:class:`StalledSends`). A driver that
  stops reading is not lost: its kernel still answers the window probes.

A rank on a lost host, or one that waits for it, therefore ends within
``LINK_TIMEOUT_S + STUCK_GRACE_S`` (30 s).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import select
import socket
import struct
import termios
import threading
import time
from types import TracebackType

logger = logging.getLogger(__name__)

LINK_TIMEOUT_S = 20.0
"""A channel whose other end has not answered for this long is given up as lost."""

STUCK_GRACE_S = 10.0
"""How long a rank whose driver is lost may take to end on its own before its process exits."""

LOST_EXIT_CODE = 75
"""The exit code of a rank process that ended itself because its driver was lost."""

#: Ranges (seconds, both ends included) of a connection's keepalive idle time and interval.
_KEEPALIVE_IDLE_S = (2, 8)
_KEEPALIVE_INTERVAL_S = (2, 4)
# struct tcp_info (linux/tcp.h): tcpi_last_ack_recv, ms since the last acknowledgement, is the u32 at byte 56
_TCP_INFO_SIZE = 60
_LAST_ACK_RECV_AT = 56
_LOST_ERRNOS = {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def keepalive_timing(rng: random.Random | None = None) -> tuple[int, int, int]:
    """``(idle, interval, probes)`` in whole seconds for one connection's keepalive: the first
    probe after ``idle`` seconds of silence, then one every ``interval``, the connection given up
    after ``probes`` unanswered ones, about :data:`LINK_TIMEOUT_S` in all.

    Each connection draws its own ``idle`` and ``interval``. Connections that fell silent at the
    same moment (every rank after the same answer) would otherwise probe at the same moment:
    at 1,024 ranks on one machine, 2,048 probes at once overflowed the kernel's per-CPU backlog
    of received packets (``net.core.netdev_max_backlog``, 1,000), the same connections lost
    their probes again and again, and the driver gave up about 2 % of them as lost hosts."""
    draw = rng.randint if rng is not None else random.randint
    idle = draw(*_KEEPALIVE_IDLE_S)
    interval = draw(*_KEEPALIVE_INTERVAL_S)
    return idle, interval, max(1, round((LINK_TIMEOUT_S - idle) / interval))


def watch_link(sock: socket.socket, sends_little: bool) -> None:
    """Make the kernel give ``sock``'s connection up after :data:`LINK_TIMEOUT_S` without an
    answer from the other end: keepalive probes while it is idle (:func:`keepalive_timing`), and,
    with ``sends_little``, the user timeout while data waits for an acknowledgement. Options this
    platform lacks are skipped.

    The user timeout also ends a connection whose receiver has not read for that long (a
    window closed that long), so only the driver's end has it: the driver sends ranks a few
    small answers that they always read, while a rank may stream output to a driver that
    stops reading for a while (its console piped into a pager, Ctrl-Z), which must only slow
    the rank down."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, probes = keepalive_timing()
    options = [("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", probes)]
    if sends_little:
        options.append(("TCP_USER_TIMEOUT", int(LINK_TIMEOUT_S * 1000)))
    for name, value in options:
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def send_queue_state(sock: socket.socket) -> tuple[int, float] | None:
    """The bytes in ``sock``'s send queue (sent and unacknowledged, or not sent yet) and the
    seconds since the other end's kernel last acknowledged anything; None where the platform
    can't tell."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or not hasattr(termios, "TIOCOUTQ"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_SIZE)
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return None
    if len(info) < _TCP_INFO_SIZE:
        return None
    (last_ack_ms,) = struct.unpack_from("I", info, _LAST_ACK_RECV_AT)
    return queued, last_ack_ms / 1000


class StalledSends:
    """The rule that finds a lost link by its send queue: data has waited there, and no
    acknowledgement came, for longer than ``timeout_s``, by observations a caller makes now and
    then (:meth:`lost`). One observation is not enough: right after a send on a connection idle
    for long, data waits and the last acknowledgement is old, for a round trip."""

    def __init__(self, timeout_s: float = LINK_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._waiting_since: float | None = None

    def lost(self, queued: int, since_ack_s: float, now: float) -> bool:
        """Whether the link is lost, given the send queue's ``queued`` bytes and the seconds
        ``since_ack_s`` since the last acknowledgement, observed at ``now`` (monotonic seconds)."""
        if queued == 0:
            self._waiting_since = None
            return False
        if self._waiting_since is None:
            self._waiting_since = now
        return now - self._waiting_since > self.timeout_s and since_ack_s > self.timeout_s


def lost_link_cause(error: BaseException, peer: str) -> str | None:
    """What to say of a rank whose channel failed with ``error``, when the error means that its
    host stopped answering (None for other errors: a closed or reset connection)."""
    if not isinstance(error, OSError) or error.errno not in _LOST_ERRNOS:
        return None
    return (
        f"lost: its host {peer} has not answered for {LINK_TIMEOUT_S:g} s ({error.strerror or error}); "
        "the network to it is cut or the machine is gone"
    )


class DriverWatch:
    """While a rank runs, end its process if the channel to the driver is lost and the train
    function does not end on its own within ``grace_s``; a context manager around the run.

    Args:
        fileno: The channel's socket.
        rank: This rank (for the message).
        driver: The driver's address (for the message).
        grace_s: How long the train function may take to end after the channel is lost.
    """

    def __init__(self, fileno: int, rank: int, driver: str, grace_s: float = STUCK_GRACE_S) -> None:
        self.fileno = fileno
        self.rank = rank
        self.driver = driver
        self.grace_s = grace_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lockstep-driver-watch", daemon=True)

    def __enter__(self) -> DriverWatch:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._done.set()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self.fileno, getattr(select, "POLLRDHUP", 0x2000))  # errors and hang-ups always count
        stalled = StalledSends()
        with socket.socket(fileno=os.dup(self.fileno)) as counters:  # only read for its TCP counters
            while not self._done.is_set():
                if poller.poll(500):
                    break
                state = send_queue_state(counters)
                if state is not None and stalled.lost(*state, now=time.monotonic()):
                    break
        if self._done.wait(self.grace_s):
            return
        logger.error(
            "rank %d: the channel to the driver at %s is gone, and this rank's train function has not ended %g s "
            "later (it is most likely waiting in a collective for a rank on a lost host). This process exits now "
            "(code %d); the driver's error names the lost rank(s).",
            self.rank,
            self.driver,
            self.grace_s,
            LOST_EXIT_CODE,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(LOST_EXIT_CODE)
