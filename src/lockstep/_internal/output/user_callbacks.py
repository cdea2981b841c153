"""Ray Train's :class:`~lockstep.callbacks.UserCallback` on lockstep's listener interface: the
:class:`UserCallbacks` listener calls each user callback's ``after_report`` once per report, in
report order, with every rank's metrics and the report's committed checkpoint (a report whose
ASYNC checkpoint is still uploading waits, with the reports after it), and ``after_exception``
with the failed ranks' errors when a worker group fails."""

from __future__ import annotations

import logging
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lockstep._internal.output.callback_base import Callback, RunInfo
from lockstep._internal.output.progress import log_clear_of_line
from lockstep.callbacks import TrainRunContext, UserCallback
from lockstep.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


class UserCallbacks(Callback):
    """The user's ``UserCallback`` objects, as one of lockstep's listeners.

    Args:
        callbacks: The user's callbacks, in the order of ``RunConfig.callbacks``.
        run_context: What their hooks get as ``run_context``.
    """

    def __init__(self, callbacks: Sequence[UserCallback], run_context: TrainRunContext) -> None:
        self.callbacks = list(callbacks)
        self.run_context = run_context
        self._reports: deque[tuple[int, list[dict[str, Any]], bool]] = deque()
        self._committed: dict[int, Checkpoint] = {}

    def after_rank_reports(self, index: int, metrics: list[dict[str, Any]], has_checkpoint: bool) -> None:
        """Every rank made report ``index`` (``metrics[i]``: rank i's); ``has_checkpoint``: its
        checkpoint is committed now or later (:meth:`on_checkpoint`)."""
        self._reports.append((index, metrics, has_checkpoint))
        self._flush()

    def on_checkpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
        self._committed[index] = checkpoint
        self._flush()

    def on_attempt_start(self, run: RunInfo, attempt: Any) -> None:
        # a failed attempt's reports whose checkpoints were never committed are not the run's
        self._reports.clear()
        self._committed.clear()

    def on_failure(self, run: RunInfo, error: Exception, restarting: bool) -> None:
        failures = getattr(error, "worker_failures", None) or {}
        for callback in list(self.callbacks):
            self._call(
                callback, callback.after_exception, run_context=self.run_context, worker_exceptions=dict(failures)
            )

    def _flush(self) -> None:
        while self._reports:
            index, metrics, has_checkpoint = self._reports[0]
            if has_checkpoint and index not in self._committed:
                return
            self._reports.popleft()
            checkpoint = self._committed.pop(index, None)
            for callback in list(self.callbacks):
                self._call(
                    callback,
                    callback.after_report,
                    run_context=self.run_context,
                    metrics=metrics,
                    checkpoint=checkpoint,
                )

    def _call(self, callback: UserCallback, hook: Callable[..., None], **kwargs: Any) -> None:
        try:
            hook(**kwargs)
        except Exception:  # noqa: BLE001 - a user's callback must not end the training
            log_clear_of_line(
                logger,
                logging.ERROR,
                "Callback %s failed in %s; it is switched off for the rest of the run:\n%s",
                type(callback).__name__,
                hook.__name__,
                traceback.format_exc(),
            )
            self.callbacks.remove(callback)
