"""Everything that hears about a run, through the one :class:`~lockstep.callbacks.Callback`
interface: lockstep's own log lines (:class:`LogLines`), the progress line
(:class:`~lockstep._internal.output.progress.ProgressCallback`) and the user's ``RunConfig.callbacks``.

The controller calls :class:`Listeners`, one method per hook, and each calls that hook on every
listener as a plain method, so a hook that does not exist is an ``AttributeError``, not a
silence.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from lockstep._internal.output.metrics_text import metrics_text
from lockstep._internal.output.progress import ProgressCallback, log_clear_of_line
from lockstep._internal.output.user_callbacks import UserCallbacks
from lockstep._internal.run.stopping import StopCondition
from lockstep.callbacks import AttemptStart, Callback, RunInfo, TrainRunContext, UserCallback
from lockstep.checkpoint import Checkpoint
from lockstep.config import RunConfig

logger = logging.getLogger(__name__)


class Listeners:
    """Calls each hook on lockstep's own listeners (``builtin``: an error in one is a bug, so it
    is raised), then on the user's ``callbacks`` (one that raises is logged with its traceback
    and switched off for the rest of the run; the training goes on).

    Args:
        run: The run every hook is called for.
        callbacks: The user's callbacks.
        builtin: lockstep's own listeners, called first.
    """

    def __init__(
        self,
        run: RunInfo,
        callbacks: Sequence[Callback] = (),
        builtin: Sequence[Callback] = (),
        user_callbacks: UserCallbacks | None = None,
    ) -> None:
        self.run = run
        self.builtin = list(builtin) + ([user_callbacks] if user_callbacks is not None else [])
        self.callbacks = list(callbacks)
        #: Ray's UserCallbacks (among ``builtin``): the controller also tells them every rank's
        #: metrics of each report, which no Callback hook carries
        self.user_callbacks = user_callbacks

    def on_run_start(self) -> None:
        """Before the first workers start."""
        for listener in self._listening():
            self._call(listener, listener.on_run_start)

    def on_attempt_start(self, attempt: AttemptStart) -> None:
        """A worker group is about to start."""
        for listener in self._listening():
            self._call(listener, listener.on_attempt_start, attempt)

    def on_workers_changed(self, alive: int) -> None:
        """A worker connected or exited; ``alive`` are running."""
        for listener in self._listening():
            self._call(listener, listener.on_workers_changed, alive)

    def after_report(self, index: int, metrics: dict[str, Any]) -> None:
        """Report ``index`` is recorded, with rank 0's ``metrics``."""
        for listener in self._listening():
            self._call(listener, listener.after_report, index, metrics)

    def on_checkpoint(self, index: int, checkpoint: Checkpoint) -> None:
        """The checkpoint of report ``index`` is committed."""
        for listener in self._listening():
            self._call(listener, listener.on_checkpoint, index, checkpoint)

    def on_failure(self, error: Exception, restarting: bool) -> None:
        """An attempt failed; ``restarting`` says whether the workers start again."""
        for listener in self._listening():
            self._call(listener, listener.on_failure, error, restarting)

    def on_run_end(self, status: str, error: Exception | None) -> None:
        """The run ended with ``status``."""
        for listener in self._listening():
            self._call(listener, listener.on_run_end, status, error)

    def _listening(self) -> list[Callback]:
        return self.builtin + self.callbacks

    def _call(self, listener: Callback, hook: Callable[..., None], *args: Any) -> None:
        """``hook(run, *args)``; a user callback that raises is logged and switched off."""
        if any(listener is trusted for trusted in self.builtin):
            hook(self.run, *args)
            return
        try:
            hook(self.run, *args)
        except Exception:  # noqa: BLE001 - a logger's failure must not end the training
            log_clear_of_line(
                logger,
                logging.ERROR,
                "Callback %s failed in %s; it is switched off for the rest of the run:\n%s",
                type(listener).__name__,
                hook.__name__,
                traceback.format_exc(),
            )
            self.callbacks.remove(listener)


class LogLines(Callback):
    """lockstep's own log lines about the run: each report and checkpoint at ``report_level``,
    failures that are retried and restarts as warnings (a failure that ends the run is raised,
    not logged).

    Args:
        report_level: The level of the per-report and per-checkpoint lines: DEBUG where a live
            progress line is already their account, else INFO.
    """

    def __init__(self, report_level: int = logging.INFO) -> None:
        self.report_level = report_level
        self._attempt_started = time.monotonic()
        self._waiting_for: int | None = None

    def on_attempt_start(self, run: RunInfo, attempt: AttemptStart) -> None:
        self._attempt_started, self._waiting_for = time.monotonic(), attempt.world_size
        resume_from = attempt.checkpoint.path if attempt.checkpoint else "the start"
        if attempt.reason == "restart":
            allowed = "unlimited" if attempt.max_failures < 0 else str(attempt.max_failures)
            log_clear_of_line(
                logger,
                logging.WARNING,
                "Restarting the workers (failure %d of %s allowed), from %s.",
                attempt.failures,
                allowed,
                resume_from,
            )
        elif attempt.reason == "grow":
            log_clear_of_line(
                logger,
                logging.WARNING,
                "More workers fit now: restarting with %d, from %s.",
                attempt.world_size,
                resume_from,
            )

    def on_workers_changed(self, run: RunInfo, alive: int) -> None:
        if self._waiting_for is not None and alive >= self._waiting_for:
            log_clear_of_line(
                logger, logging.INFO, "%d workers ready in %.2f s.", alive, time.monotonic() - self._attempt_started
            )
            self._waiting_for = None

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        log_clear_of_line(logger, self.report_level, "report #%d: %s", index, metrics_text(metrics, limit=200))

    def on_checkpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
        name = os.path.basename(checkpoint.path.rstrip("/"))
        log_clear_of_line(logger, self.report_level, "checkpoint %s committed (report #%d).", name, index)

    def on_failure(self, run: RunInfo, error: Exception, restarting: bool) -> None:
        if restarting:
            log_clear_of_line(logger, logging.WARNING, "%s", error)


def listeners_for(
    run_config: RunConfig, run: RunInfo, extra: Sequence[Callback] = (), run_context: TrainRunContext | None = None
) -> Listeners:
    """The listeners of a run: lockstep's log lines, the progress line (unless ``verbose=0``),
    ``run_config.stop``, the driver's ``extra`` built-in listeners (e.g. the metrics exporter)
    and ``run_config.callbacks`` (Ray's UserCallbacks among them are called with
    ``run_context``). Where the progress line is live (a terminal), it is the account of
    each report, so the per-report log lines go to DEBUG instead of onto the console."""
    progress = ProgressCallback(run.name, run.world_size) if run_config.verbose != 0 else None
    report_level = logging.DEBUG if progress is not None and progress.live else logging.INFO
    builtin: list[Callback] = [LogLines(report_level), *([progress] if progress is not None else [])]
    if run_config.stop is not None:
        builtin.append(StopCondition(run_config.stop))
    ours = [callback for callback in run_config.callbacks if isinstance(callback, Callback)]
    rays = [callback for callback in run_config.callbacks if isinstance(callback, UserCallback)]
    user_callbacks = None
    if rays:
        context = run_context or TrainRunContext(
            run_config=run_config, train_loop_config=None, scaling_config=None, backend_config=None, dataset_config=None
        )
        user_callbacks = UserCallbacks(rays, context)
    return Listeners(run, ours, [*builtin, *extra], user_callbacks)
