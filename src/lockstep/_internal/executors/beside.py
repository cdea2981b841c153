"""Driving a run from a thread of the process whose main thread runs rank 0 itself: torchrun's
rank 0 (``external.py``) and local mode (``local_mode.py``). One sequence for both: prepare
the controller for the attached group (stopping the group if that fails), drive it on a
:class:`ControllerThread` while this thread runs rank 0, then wait for the thread."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from lockstep._internal.run.worker_group import GroupFactory
from lockstep._internal.wire.link_watch import LOST_EXIT_CODE, STUCK_GRACE_S

if TYPE_CHECKING:
    from lockstep._internal.executors.attached_group import AttachedGroup
    from lockstep._internal.run.controller import Controller
    from lockstep._internal.run.driver import RunDriver
    from lockstep.result import Result

logger = logging.getLogger(__name__)
T = TypeVar("T")


def drive_beside_rank_0(
    driver: RunDriver,
    executor: str,
    group: AttachedGroup,
    run_rank: Callable[[Controller], T],
    announce: Callable[[BaseException | None], None] | None = None,
    prepared: Callable[[Controller], None] | None = None,
    failed_to_prepare: Callable[[BaseException], None] | None = None,
    watch_hangs: bool = True,
) -> tuple[T, ControllerThread]:
    """Prepare ``driver``'s controller for ``group`` (``prepared`` runs next, as part of it; on a
    failure of either the group stops, ``failed_to_prepare`` hears of it, and it is raised), then
    drive the run on a :class:`ControllerThread` (with ``announce``) while this thread runs
    ``run_rank(controller)``; return what ``run_rank`` returned and the joined thread. The
    controller watches for hangs unless not ``watch_hangs``."""
    size = group.listener.world_size
    try:
        factory = GroupFactory(executor, lambda _: group, size, size)
        controller = driver.prepare(factory, restarts=False, watch_hangs=watch_hangs)
        if prepared is not None:
            prepared(controller)
    except BaseException as error:
        group.stop()
        if failed_to_prepare is not None:
            failed_to_prepare(error)
        raise
    thread = ControllerThread(lambda: driver.drive(controller), announce)
    thread.start()
    try:
        outcome = run_rank(controller)
    finally:
        thread.rank_done.set()
    try:
        thread.ended.wait()  # not join(): a join that Ctrl-C interrupts takes the thread for ended
    except BaseException:  # Ctrl-C while the controller still works (it waits for validations)
        controller.preemption.hang_up("Ctrl-C while fit() waited for the run to end")
        thread.ended.wait()  # it aborts the validations and records the run interrupted
        raise
    thread.join()
    return outcome, thread


class ControllerThread(threading.Thread):
    """Drives the run on rank 0, beside its train function. With ``announce`` (under torchrun):
    when the run has ended and rank 0's train function does not end within ``STUCK_GRACE_S``
    (it waits in a collective for a rank on a lost host: nothing can interrupt it), the thread
    reports the run's end with ``announce`` and ends the process, saying why.

    Attributes:
        rank_done: Set by the main thread once rank 0's train function has ended.
        ended: Set when the run has ended (its result or error is in place).
    """

    def __init__(
        self, drive: Callable[[], Result], announce: Callable[[BaseException | None], None] | None = None
    ) -> None:
        super().__init__(daemon=True, name="lockstep-controller")
        self.drive = drive
        self.announce = announce
        self.rank_done = threading.Event()
        self.ended = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.drive()
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self.error = error
        finally:
            self.ended.set()
        if self.announce is not None and not self.rank_done.wait(STUCK_GRACE_S):
            self._end_stuck_rank(self.announce)

    def _end_stuck_rank(self, announce: Callable[[BaseException | None], None]) -> None:
        logger.error(
            "The run has ended (%s), but rank 0's train function has not returned %g s later (it is most "
            "likely waiting in a collective for a rank that is gone). This process exits now (code %d).",
            "succeeded" if self.error is None else f"{type(self.error).__name__}: {self.error}",
            STUCK_GRACE_S,
            LOST_EXIT_CODE,
        )
        try:
            announce(self.error)
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(LOST_EXIT_CODE)

    def outcome(self) -> Result:
        """The run's Result, once the thread has ended.

        Raises:
            BaseException: what driving the run raised.
        """
        if self.error is not None:
            raise self.error
        return self.result
