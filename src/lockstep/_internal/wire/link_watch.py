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

A rank on a lost host, or one that waits for it, therefore ends within
``LINK_TIMEOUT_S + STUCK_GRACE_S`` (30 s).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
from types import TracebackType

logger = logging.getLogger(__name__)

LINK_TIMEOUT_S = 20.0
"""A channel whose other end has not answered for this long is given up as lost."""

STUCK_GRACE_S = 10.0
"""How long a rank whose driver is lost may take to end on its own before its process exits."""

LOST_EXIT_CODE = 75
"""The exit code of a rank process that ended itself because its driver was lost."""

_KEEPALIVE_PROBES = 3
_LOST_ERRNOS = {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def watch_link(sock: socket.socket, sends_little: bool) -> None:
    """Make the kernel give ``sock``'s connection up after :data:`LINK_TIMEOUT_S` without an
    answer from the other end: keepalive probes while it is idle, and, with ``sends_little``,
    the user timeout while data waits for an acknowledgement. Options this platform lacks are
    skipped.

    The user timeout also ends a connection whose receiver has not read for that long (a
    window closed that long), so only the driver's end has it: the driver sends ranks a few
    small answers that they always read, while a rank may stream output to a driver that
    stops reading for a while (its console piped into a pager, Ctrl-Z), which must only slow
    the rank down."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probe_every = max(1, int(LINK_TIMEOUT_S / (_KEEPALIVE_PROBES + 1)))
    options = [("TCP_KEEPIDLE", probe_every), ("TCP_KEEPINTVL", probe_every), ("TCP_KEEPCNT", _KEEPALIVE_PROBES)]
    if sends_little:
        options.append(("TCP_USER_TIMEOUT", int(LINK_TIMEOUT_S * 1000)))
    for name, value in options:
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


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
        while not self._done.is_set():
            if poller.poll(500):
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
