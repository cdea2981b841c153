"""A rank's progress thread: it tells the driver's hang detector how far the rank got (a
:class:`~lockstep._internal.wire.protocol.Progress` message when the counters of
:mod:`lockstep._internal.rank.progress` changed, at most every ``every_s`` seconds), and answers
the driver's :class:`~lockstep._internal.wire.protocol.StacksWanted` while the train function is
busy elsewhere.

Only one thread reads the channel at a time: the train function holds ``calls`` (see
:class:`~lockstep._internal.rank.worker_session.WorkerSession`) from sending a call until its
answer came, and answers a StacksWanted that arrives meanwhile itself. This thread reads only
when the channel has something to read and ``calls`` is free, which happens only for a
StacksWanted (every other driver message answers a call).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from lockstep._internal.rank.progress import PROGRESS, count_optimizer_steps
from lockstep._internal.rank.whereabouts import collective_in_flight, default_flight_recorder, python_stacks
from lockstep._internal.wire import protocol

if TYPE_CHECKING:
    from lockstep._internal.wire.channel import WorkerChannel

__all__ = ["ProgressSender", "progress_reported", "where_i_am"]

logger = logging.getLogger(__name__)

#: How often the thread looks for a StacksWanted, at most.
LOOK_EVERY_S = 0.5


def where_i_am(rank: int) -> protocol.Stacks:
    """This rank's answer to StacksWanted."""
    collective, known = collective_in_flight()
    return protocol.Stacks(
        rank=rank,
        stacks=python_stacks(PROGRESS.train_thread),
        collective=collective,
        collectives_known=known,
        work=PROGRESS.work,
    )


@contextmanager
def progress_reported(
    channel: WorkerChannel, rank: int, every_s: float | None, calls: threading.Lock
) -> Iterator[None]:
    """While the ``with`` block runs the train function, report this rank's progress every
    ``every_s`` seconds at most (None: the hang detector is off, nothing is sent)."""
    PROGRESS.restart()
    if every_s is None:
        yield
        return
    count_optimizer_steps()
    default_flight_recorder()
    sender = ProgressSender(channel, rank, every_s, calls)
    sender.start()
    try:
        yield
    finally:
        sender.stop()


class ProgressSender(threading.Thread):
    """The progress thread (see the module's docstring).

    Args:
        channel: The rank's channel to the driver.
        rank: This rank.
        every_s: The least time between two Progress messages.
        calls: Held by the train function while it waits for the driver's answer to a call.
    """

    def __init__(self, channel: WorkerChannel, rank: int, every_s: float, calls: threading.Lock) -> None:
        super().__init__(name="lockstep-progress", daemon=True)
        self.channel = channel
        self.rank = rank
        self.every_s = every_s
        self.calls = calls
        self._stopped = threading.Event()
        self._poller = select.poll()
        self._poller.register(channel.fileno(), select.POLLIN)

    def stop(self) -> None:
        """End the thread (it is a daemon: a send stuck on a full socket does not keep the rank)."""
        self._stopped.set()
        self.join(timeout=1.0)

    def run(self) -> None:
        sent: tuple[int, int, bool] | None = None
        sent_at = float("-inf")
        try:
            while not self._stopped.wait(min(self.every_s, LOOK_EVERY_S)):
                self._answer_if_asked()
                now = time.monotonic()
                state = (PROGRESS.work, PROGRESS.steps, PROGRESS.busy)
                if state != sent and now - sent_at >= self.every_s:
                    self.channel.send(protocol.Progress(self.rank, *state, step_s=PROGRESS.median_step_s()))
                    sent, sent_at = state, now
        except (EOFError, OSError, ValueError) as error:  # the channel is gone: the train function hears of it
            logger.debug("rank %d's progress thread ends: %s", self.rank, error)

    def _answer_if_asked(self) -> None:
        """Answer a StacksWanted waiting on the channel, unless the train function reads it."""
        if not self._poller.poll(0) or not self.calls.acquire(blocking=False):
            return
        try:
            if not self._poller.poll(0):
                return
            message = self.channel.recv()
            if isinstance(message, protocol.StacksWanted):
                self.channel.send(where_i_am(self.rank))
            else:
                logger.error("rank %d: the driver sent a %s nobody asked for (a lockstep bug)", self.rank, message)
        finally:
            self.calls.release()
