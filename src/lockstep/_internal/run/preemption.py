"""Preemption notices: a SIGTERM is a notice, not a crash.

Spot VMs, Slurm and Kubernetes send SIGTERM some seconds before they take a machine away
(Kubernetes' default grace period is 30 s). lockstep then trains on until the next checkpoint is
committed and stops the run as ``preempted``:

- the driver's SIGTERM (its machine goes away: every rank is affected) is caught by
  :func:`driver_signals` where the controller runs on the main thread (local and Ray
  executors); a second SIGTERM, or the grace running out (SIGALRM), raises
  :class:`PreemptionStop` there, which ends the run at once, as Ctrl-C does;
- a rank's SIGTERM (a pod eviction; torchrun forwards its own SIGTERM to every rank) is caught
  by :func:`rank_signals`, which sends a ``PreemptionNotice`` on the rank's channel from a
  thread (the handler can't take the channel's send lock: the interrupted code may hold it).

SIGHUP (the terminal closed; torchrun passes its own on to every rank) ends the run as
``interrupted``: :func:`driver_signals` raises :class:`HangUp` in the controller; where the
controller runs on a thread beside a train function (rank 0 under torchrun, local mode),
:func:`rank_signals` raises it in the train function after telling the controller
(:meth:`Preemption.hang_up`), which raises it at its next check of :attr:`Preemption.stops_now`.

The controller keeps the notice in a :class:`Preemption`, tells every rank at its next
``report()`` and says when the run stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lockstep._internal.wire import protocol
from lockstep._internal.wire.channel import WorkerChannel
from lockstep.errors import HangUp, PreemptionError
from lockstep.preemption import PreemptionInfo

logger = logging.getLogger(__name__)


class PreemptionStop(BaseException):
    """Ends what runs at once because the run stops preempted (a BaseException, as
    KeyboardInterrupt, so that a train function's ``except Exception`` doesn't swallow it)."""


class Preemption:
    """The driver's account of a preemption notice: which ranks on which hosts, the deadline,
    and whether the run must stop now.

    Args:
        grace_s: How long after the first notice the run may go on (``FailureConfig.preemption_grace_s``).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.node_to_ranks: dict[str, set[int]] = {}
        self.deadline: float | None = None
        self.deadline_ms: int | None = None
        self.checkpoint_committed = False
        self.reports_from: int | None = None  # the first report completed after the notice
        self.urgent = False
        self.finishing = False
        self.hung_up: str | None = None
        self.cause = "SIGTERM"
        self.notices = 0  # every notice, the driver's and the ranks' (the metrics count them)

    @property
    def noticed(self) -> bool:
        """Whether a notice came."""
        return self.deadline is not None

    def notice(
        self, host: str, ranks: list[int], urgent: bool = False, cause: str = "SIGTERM", deadline_ms: int | None = None
    ) -> None:
        """``ranks`` on ``host`` got a notice (``urgent``: a second one, stop at once) for
        ``cause``; a ``deadline_ms`` (epoch ms) sooner than the grace shortens it."""
        self.notices += 1
        if self.deadline is None:
            grace_s = self.grace_s
            if deadline_ms:
                grace_s = max(0.0, min(grace_s, deadline_ms / 1000 - time.time()))
            self.deadline = time.monotonic() + grace_s
            self.deadline_ms = int((time.time() + grace_s) * 1000)
            self.cause = cause
            logger.warning(
                "Preemption notice (%s) for rank(s) %s on %s: training goes on until the next "
                "checkpoint is committed, %.0f s at most, then the run stops.",
                cause,
                ranks,
                host,
                grace_s,
            )
        self.node_to_ranks.setdefault(host, set()).update(ranks)
        if urgent and not self.urgent:
            logger.warning("A second SIGTERM: the run stops now (preempted).")
        self.urgent = self.urgent or urgent

    def report_completed(self, index: int) -> None:
        """Report ``index`` is complete (every rank made it): the first after a notice is where
        the ranks' answers to it can begin."""
        if self.noticed and self.reports_from is None:
            self.reports_from = index

    def committed(self, report_index: int) -> None:
        """The checkpoint of report ``report_index`` was committed; the run stops there when it
        was reported after the notice (an ASYNC upload from before it that ends late does not
        stop the run: the checkpoints reported in answer to the notice are still to come)."""
        if self.noticed and self.reports_from is not None and report_index >= self.reports_from:
            self.checkpoint_committed = True

    def hang_up(self, reason: str) -> None:
        """The process got SIGHUP while the controller runs on another thread: the controller
        raises :class:`HangUp` at its next check of :attr:`stops_now` (unless the run is
        already finishing)."""
        if not self.finishing:
            self.hung_up = reason

    @property
    def stops_now(self) -> bool:
        """Whether the run must stop: a checkpoint was committed after the notice, a second
        notice came, or the grace ran out.

        Raises:
            HangUp: :meth:`hang_up` was called (the run then ends as interrupted).
        """
        if self.hung_up is not None and not self.finishing:
            self.finishing = True
            raise HangUp(self.hung_up)
        return self.noticed and (self.checkpoint_committed or self.urgent or self.time_left() == 0.0)

    def time_left(self) -> float | None:
        """Seconds until the grace runs out; None before any notice."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def message(self) -> protocol.Preempted | None:
        """The notice as ranks learn it, or None before any."""
        if not self.noticed:
            return None
        return protocol.Preempted(self.deadline_ms, {host: sorted(ranks) for host, ranks in self.node_to_ranks.items()})

    def info(self) -> PreemptionInfo:
        """The notice as ``get_preemption_info()`` and PreemptionError show it."""
        return info_from(self.message() or protocol.Preempted(None))

    def error(self, latest_checkpoint: str | None) -> PreemptionError:
        """The error ``fit()`` raises for this preemption."""
        info = self.info()
        if self.checkpoint_committed:
            how = "stopped after committing its next checkpoint"
        else:
            how = "stopped before another checkpoint was committed (" + self._why_early() + ")"
        return PreemptionError(
            f"The run was preempted: {self.cause} for rank(s) {info.preempted_ranks} on "
            f"{', '.join(info.preempted_node_ids)}; "
            f"it {how}. Its latest checkpoint is {latest_checkpoint or 'none'}: run the same command again to "
            "continue from it (a preemption is not counted as a failure).",
            info,
            drain_timed_out=not self.checkpoint_committed,
        )

    def _why_early(self) -> str:
        if self.urgent:
            return "a second SIGTERM"
        if self.time_left() == 0.0:
            return f"FailureConfig.preemption_grace_s={self.grace_s:g} ran out"
        return "a rank ended"


def info_from(message: protocol.Preempted) -> PreemptionInfo:
    """The public PreemptionInfo of a Preempted message."""
    return PreemptionInfo(message.deadline_ms, {host: list(ranks) for host, ranks in message.node_to_ranks.items()})


def on_main_thread() -> bool:
    """Signal handlers can only be installed from the main thread."""
    return threading.current_thread() is threading.main_thread()


@contextmanager
def driver_signals(preemption: Preemption, ranks: Callable[[], list[int]]) -> Iterator[None]:
    """While the run is driven on this (main) thread: SIGTERM is a notice for ``ranks()``;
    a second SIGTERM or the grace running out raises :class:`PreemptionStop`; SIGHUP raises
    :class:`HangUp`. Off the main thread, nothing is installed."""
    if not on_main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        if preemption.finishing:
            return
        if preemption.noticed:
            preemption.notice(socket.gethostname(), [], urgent=True)
            preemption.finishing = True
            raise PreemptionStop("a second SIGTERM")
        preemption.notice(socket.gethostname(), ranks())
        signal.setitimer(signal.ITIMER_REAL, max(preemption.grace_s, 0.001))

    def on_alarm(signum: int, frame: Any) -> None:
        if not preemption.finishing:
            preemption.finishing = True
            raise PreemptionStop(f"preemption_grace_s={preemption.grace_s:g} ran out")

    def on_hangup(signum: int, frame: Any) -> None:
        if not preemption.finishing:
            preemption.finishing = True
            raise HangUp("the driver got SIGHUP (its terminal closed)")

    handlers = {signal.SIGTERM: on_term, signal.SIGALRM: on_alarm, signal.SIGHUP: on_hangup}
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


RANK_HANGUP = "this process got SIGHUP (its terminal closed, or torchrun passed its own SIGHUP on)"


class RankSignals:
    """How many SIGTERMs this rank's process got (each one sent on as a notice), and whether
    it got SIGHUP."""

    def __init__(self) -> None:
        self.received = 0
        self.hung_up = False


@contextmanager
def rank_signals(
    channel: WorkerChannel,
    rank: int,
    hang_up: bool = False,
    controller: Preemption | None = None,
) -> Iterator[RankSignals]:
    """While a rank runs on this (main) thread: each SIGTERM sends a PreemptionNotice (the
    second one urgent) and the train function goes on. With ``hang_up``, the first SIGHUP
    raises :class:`HangUp` in the train function (later ones are ignored), after telling
    ``controller`` (the Preemption of a controller that runs on a thread of this process), so
    that the run ends as interrupted. Off the main thread, nothing is installed."""
    seen = RankSignals()
    if not on_main_thread():
        yield seen
        return

    owner = os.getpid()

    def in_forked_child(signum: int) -> bool:
        """A forked child (a DataLoader worker) must not use the channel: it takes the signal's
        default action instead."""
        if os.getpid() == owner:
            return False
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return True

    def on_term(signum: int, frame: Any) -> None:
        if in_forked_child(signum):
            return
        seen.received += 1
        notice = protocol.PreemptionNotice(rank, socket.gethostname(), urgent=seen.received > 1)
        threading.Thread(target=_send_quietly, args=(channel, notice), name="lockstep-notice", daemon=True).start()

    def on_hangup(signum: int, frame: Any) -> None:
        if in_forked_child(signum) or seen.hung_up:
            return
        seen.hung_up = True
        if controller is not None:
            controller.hang_up(RANK_HANGUP)
        raise HangUp(RANK_HANGUP)

    handlers = {signal.SIGTERM: on_term, **({signal.SIGHUP: on_hangup} if hang_up else {})}
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield seen
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def hung_up(outcome: Any) -> bool:
    """Whether a rank's outcome is the :class:`HangUp` its SIGHUP raised in the train function."""
    return isinstance(outcome, protocol.Failed) and outcome.failure.error_type == HangUp.__name__


def _send_quietly(channel: WorkerChannel, message: Any) -> None:
    """Send ``message``; a driver that is gone or closed the channel ends the run anyway."""
    with contextlib.suppress(OSError):
        channel.send(message)
