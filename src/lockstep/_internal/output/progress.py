"""The driver's progress line: where the run is, on one line that updates in place on a terminal,
or as a plain line now and then when the output is a file or a pipe.

    lockstep mnist | report 12 | 0:01:23 | 2/2 workers | ckpt checkpoint_000011 | slow: rank 1 (data) | loss=0.3123

``slow:`` names a rank that holds the others back (see :mod:`lockstep._internal.run.stragglers`).

Workers' console output and the line share the terminal: the line is wiped before their output
is written and drawn again after it (see :func:`around_output`).

Several fits at once in one driver (threads, e.g. ``study.optimize(..., n_jobs=2)``) share one
terminal line: it shows the oldest running fit; each of the others writes its last state on a
line of its own when it ends, and the next oldest takes over the line. Without a terminal, each
fit writes its own plain lines.

The line goes to stderr; lockstep's log messages, when you turn them on, go wherever logging
sends them. On a terminal the line is the account of each report, so lockstep logs its
per-report lines at DEBUG there, and writes its other messages with :func:`log_clear_of_line`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from lockstep._internal.output.metrics_text import metrics_text
from lockstep._internal.run.stragglers import SlowRank
from lockstep.callbacks import AttemptStart, Callback, RunInfo
from lockstep.checkpoint import Checkpoint

#: Without a terminal, a plain line at most this often (and at the end).
PLAIN_INTERVAL_S = 30.0

logger = logging.getLogger(__name__)
_active: ProgressCallback | None = None  # the line on the terminal: the oldest running fit's
_running: list[ProgressCallback] = []  # the lines of the fits running in this process, oldest first
_lock = threading.RLock()


class ProgressCallback(Callback):
    """What the driver shows while a run goes on: a built-in callback, active (the line that
    workers' console output is written around) from ``on_run_start`` to ``on_run_end``."""

    def __init__(self, name: str, world_size: int, stream: IO[str] | None = None) -> None:
        self.name = name
        self.world_size = world_size
        self.stream = stream or sys.stderr
        self.live = _is_terminal(self.stream)
        self.started_at = time.monotonic()
        self.report_index: int | None = None
        self.metrics: dict[str, Any] = {}
        self.workers_alive = 0
        self.checkpoint: str | None = None
        self.restarts = 0
        self.slow_rank: SlowRank | None = None
        self._drawn = False
        self._last_plain = 0.0
        self._mid_output_line = False

    # -- what happened (the Callback hooks) -----------------------------------------------------

    def on_run_start(self, run: RunInfo) -> None:
        global _active
        self.started_at = time.monotonic()
        with _lock:
            _running.append(self)
            _active = _running[0]

    def on_attempt_start(self, run: RunInfo, attempt: AttemptStart) -> None:
        self.world_size = attempt.world_size
        self.restarts += attempt.reason == "restart"
        self.on_workers_changed(run, 0)

    def on_workers_changed(self, run: RunInfo, alive: int) -> None:
        self.workers_alive = alive
        self._show()

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        self.report_index, self.metrics = index, metrics
        self._show()

    def on_checkpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
        self.checkpoint = os.path.basename(checkpoint.path.rstrip("/"))
        self._show()

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        global _active
        with _lock:
            self.finish(status)
            if self in _running:
                _running.remove(self)
            _active = _running[0] if _running else None
            if _active is not None and _active is not self and _active.live:
                _active._write_line(_active.text(), final=False)

    def finish(self, status: str) -> None:
        """The run ended: leave the last state on its own line (above another fit's line)."""
        with _lock:
            if _active is not None and _active is not self:
                _active.wipe()
            elif self.live and self._mid_output_line:
                self.stream.write("\n")
            self._write_line(f"{self.text()} | {status}", final=True)

    # -- drawing ---------------------------------------------------------------------------------

    def text(self) -> str:
        """The line's text (without terminal control characters)."""
        elapsed = int(time.monotonic() - self.started_at)
        parts = [
            f"lockstep {self.name}",
            "no report yet" if self.report_index is None else f"report {self.report_index}",
            f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}",
            f"{self.workers_alive}/{self.world_size} workers",
        ]
        if self.restarts:
            parts.append(f"{self.restarts} restart(s)")
        if self.checkpoint:
            parts.append(f"ckpt {self.checkpoint}")
        if self.slow_rank is not None:
            parts.append(f"slow: {self.slow_rank.short()}")
        if self.metrics:
            parts.append(metrics_text(self.metrics, separator=" ", scalars_only=True))
        return " | ".join(parts)

    def _show(self) -> None:
        with _lock:
            if self.live and (self._mid_output_line or _active is not self):
                return  # mid-output, or the terminal's line shows another fit
            if self.live:
                self._write_line(self.text(), final=False)
            elif time.monotonic() - self._last_plain >= PLAIN_INTERVAL_S and self.report_index is not None:
                self._last_plain = time.monotonic()
                self._write_line(self.text(), final=True)

    def _write_line(self, text: str, final: bool) -> None:
        if self.live:
            width = shutil.get_terminal_size((120, 20)).columns - 1
            if not final and len(text) > width:  # a line that wraps can't be redrawn in place
                text = text[: width - 1] + "…"
            self.stream.write(f"\r{text}\x1b[K" + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._drawn = self.live and not final

    def wipe(self) -> None:
        """Take the line off the terminal (before other output is written)."""
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def after_output(self, ends_line: bool) -> None:
        """Other output was written: draw the line again, unless that output stopped mid-line
        (then the line waits, so as not to overwrite it)."""
        self._mid_output_line = not ends_line
        if self.live and ends_line:
            self._write_line(self.text(), final=False)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def around_output(ends_line: bool = True) -> Iterator[None]:
    """Wrap a write of workers' output to the console: wipe the line before, and draw it again
    after, unless the output stopped mid-line (the next update draws it then)."""
    with _lock:
        line = _active
        if line is not None:
            line.wipe()
        try:
            yield
        finally:
            if line is not None:
                line.after_output(ends_line)


def note_slow_rank(slow: SlowRank | None, run_name: str) -> None:
    """Show ``slow`` (or no slow rank) on the progress line of run ``run_name`` from its next
    update; log when the slow rank changes (naming the run when several fits run here)."""
    with _lock:
        line = next((running for running in _running if running.name == run_name), None)
        several = len(_running) > 1
    if line is None or line.slow_rank == slow:
        return
    if slow is not None and (line.slow_rank is None or line.slow_rank.rank != slow.rank):
        run = f"run {run_name}: " if several else ""
        log_clear_of_line(logger, logging.INFO, "%sslowest: %s (the other ranks wait for it)", run, slow.describe())
    line.slow_rank = slow


def log_clear_of_line(log: logging.Logger, level: int, message: str, *args: Any) -> None:
    """Log ``message % args`` at ``level`` without writing over the active progress line: the
    line is wiped before the record is handled and drawn again after it."""
    if log.isEnabledFor(level):
        with around_output():
            log.log(level, message, *args, stacklevel=2)
