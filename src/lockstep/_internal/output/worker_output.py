"""Where workers' printed output goes: every rank's stdout and stderr into its own log file,
and the chosen ranks' output to the driver's console as well.

With ``console="all"`` the console shows each line once however many ranks print it: a line
every rank prints at the same point reads ``[ranks 0-3] text``, a line of one rank
``[rank 2] text``. To find its twins, a complete line waits until every known rank printed it,
or at most :data:`MERGE_WAIT_S` (one small timer thread keeps that bound when no more output
comes); a rank's lines always keep their order, and the log files get every byte at once.
Output that doesn't end a line is held the same short while, except text with a ``\r`` (a
progress bar), which goes to the console at once.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Literal

from lockstep._internal.console_lines import shown_lines
from lockstep._internal.output.pipe_reader import PipeReader
from lockstep._internal.output.progress import around_output
from lockstep._internal.rank_spans import rank_span

ConsoleMode = Literal["rank0", "all", "none"]
CONSOLE_MODES: tuple[ConsoleMode, ...] = ("rank0", "all", "none")
TAIL_LINES = 20
MERGE_WAIT_S = 0.5
LOG_PARTIAL_MAX = 65536
"""The most of an unfinished line a rank's log holds back for its end."""
MAX_WAITING_LINES = 1000

Show = Callable[[bytes, bool], None]
"""Writes bytes to the console: ``show(text, is_stderr)``."""


class OutputRelay:
    """Copies each worker's output, as it comes (progress bars included), to
    ``<log_dir>/rank_<r>.log`` and, for the shown ranks, to this process's stdout/stderr; with
    ``console="all"`` through a :class:`MergingConsole` (each line once, tagged with its ranks).

    Output arrives two ways: pipes from the ranks' processes (:meth:`attach`), read by one
    thread that waits on all of them at once (:class:`PipeReader`), whatever the number of
    ranks; or messages over the channel (:meth:`write`, from executors whose ranks run elsewhere)."""

    def __init__(self, log_dir: str, console: ConsoleMode, merge_wait_s: float = MERGE_WAIT_S) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.console = console
        self._lock = threading.Condition()
        self._files: dict[int, IO[bytes]] = {}
        self._log_partial: dict[tuple[int, bool], bytes] = {}
        self._stderr_tails: dict[int, collections.deque[bytes]] = {}
        self._merging = MergingConsole(_show_on_console, merge_wait_s) if console == "all" else None
        self._timer: threading.Thread | None = None
        self._pipes: PipeReader | None = None
        self._closing = False

    def log_path(self, rank: int) -> str:
        """The log file of ``rank``."""
        return os.path.join(self.log_dir, f"rank_{rank}.log")

    def expect(self, rank: int) -> None:
        """Count ``rank`` among the ranks whose lines the console merges (it said Hello)."""
        with self._lock:
            if self._merging is not None:
                self._merging.ranks.add(rank)

    def attach(self, rank: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        """Start copying one rank's two streams (pipes from its process)."""
        with self._lock:
            self._log_file(rank)
        self.expect(rank)
        if self._pipes is None:
            self._pipes = PipeReader(self.write)
        self._pipes.add(rank, stdout, is_stderr=False)
        self._pipes.add(rank, stderr, is_stderr=True)

    def write(self, rank: int, chunk: bytes, is_stderr: bool) -> None:
        """Take ``chunk`` of what ``rank`` wrote: into its log, and to the console if shown."""
        with self._lock:
            self._write_log(rank, chunk, is_stderr)
            if is_stderr:  # a relayed rank's first chunk may come before its log file (no line end yet)
                tail = self._stderr_tails.setdefault(rank, collections.deque(maxlen=TAIL_LINES))
                tail.extend(_newline_pieces(chunk))  # lines end at \n only: a bar's \r states stay in one
            if self._merging is not None:
                self._merging.take(rank, chunk, is_stderr, time.monotonic())
                self._wake_timer()
            elif self.console == "rank0" and rank == 0:
                _show_on_console(chunk, is_stderr)

    def _write_log(self, rank: int, chunk: bytes, is_stderr: bool) -> None:
        """Append ``chunk`` to ``rank``'s log, whole lines only (a line ends at ``\\n`` or a
        progress bar's ``\\r``): the rest waits for the stream's next chunk, so that a line of
        stdout is never cut by one of stderr, whose pipe is read apart (lock held)."""
        data = self._log_partial.pop((rank, is_stderr), b"") + chunk
        end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        if len(data) - end > LOG_PARTIAL_MAX:
            end = len(data)
        if end < len(data):
            self._log_partial[(rank, is_stderr)] = data[end:]
        if end:
            log = self._log_file(rank)
            log.write(data[:end])
            log.flush()

    def _log_file(self, rank: int) -> IO[bytes]:
        """``rank``'s open log file (created on first use; call with the lock held)."""
        if rank not in self._files:
            self._files[rank] = open(self.log_path(rank), "ab")  # noqa: SIM115 - closed in close()
            self._stderr_tails.setdefault(rank, collections.deque(maxlen=TAIL_LINES))
        return self._files[rank]

    def _wake_timer(self) -> None:
        """Make sure held output is shown when due though no more comes (lock held)."""
        if self._timer is None and not self._closing:
            self._timer = threading.Thread(target=self._show_when_due, daemon=True, name="lockstep-output-timer")
            self._timer.start()
        self._lock.notify()

    def _show_when_due(self) -> None:
        assert self._merging is not None
        with self._lock:
            while not self._closing:
                due = self._merging.next_due()
                self._lock.wait(None if due is None else max(0.0, due - time.monotonic()))
                self._merging.show_due(time.monotonic())

    def stderr_tail(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr, as a terminal shows them (a progress bar's
        last state)."""
        text = b"".join(self._stderr_tails.get(rank, ())).decode(errors="replace")
        return "".join(line + "\n" for line in shown_lines(text) if line)

    def tail_with_log_path(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr, then where its full log is."""
        tail = self.stderr_tail(rank).rstrip()
        where = f"(full output: {self.log_path(rank)})"
        return f"{tail}\n{where}" if tail else where

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait for the streams to end (their processes are gone), show what the console still
        holds, and close the log files."""
        if self._pipes is not None:
            self._pipes.close(timeout_s)
        with self._lock:
            self._closing = True
            self._lock.notify()
            if self._merging is not None:
                self._merging.show_all()
            for (rank, _), rest in self._log_partial.items():
                self._log_file(rank).write(rest)
            self._log_partial.clear()
            for handle in self._files.values():
                handle.close()
            self._files.clear()
        if self._timer is not None:
            self._timer.join(timeout_s)


def _show_on_console(text: bytes, is_stderr: bool) -> None:
    """Write workers' output to this process's stdout or stderr, clear of the progress line."""
    console = sys.stderr if is_stderr else sys.stdout
    with around_output(ends_line=text.endswith(b"\n")):
        console.buffer.write(text) if hasattr(console, "buffer") else console.write(text.decode(errors="replace"))
        console.flush()


@dataclass
class _Line:
    """A complete line some ranks printed, waiting for the others."""

    text: bytes
    ranks: set[int]
    since: float
    order: int


class _WaitingLines:
    """One console stream's complete lines that wait for their twins from other ranks, in the
    order they first came. They are shown in that order, so each rank's lines keep theirs."""

    def __init__(self, show: Callable[[bytes], None]) -> None:
        self._show = show
        self._queue: collections.deque[_Line] = collections.deque()
        self._by_text: dict[bytes, list[_Line]] = {}
        self._last_of_rank: dict[int, _Line] = {}
        self._count = 0

    def add(self, rank: int, text: bytes, ranks: set[int], now: float) -> None:
        """``rank`` printed the line ``text``: join the first waiting twin it can (one that came
        after this rank's own waiting lines), or wait as a new line; show what is complete."""
        line = self._twin(rank, text)
        if line is None:
            line = _Line(text, set(), now, self._count)
            self._count += 1
            self._queue.append(line)
            self._by_text.setdefault(text, []).append(line)
        line.ranks.add(rank)
        self._last_of_rank[rank] = line
        if line.ranks >= ranks:
            self.show_through(line)
        while len(self._queue) > MAX_WAITING_LINES:
            self.show_through(self._queue[0])

    def _twin(self, rank: int, text: bytes) -> _Line | None:
        last = self._last_of_rank.get(rank)
        after = last.order if last is not None else -1
        return next((line for line in self._by_text.get(text, ()) if line.order > after), None)

    def show_through(self, last: _Line | None) -> None:
        """Show the waiting lines up to ``last`` (all of them when it is None), oldest first."""
        while self._queue and (last is None or self._queue[0].order <= last.order):
            self._show_first()

    def show_rank(self, rank: int) -> None:
        """Show the waiting lines up to ``rank``'s last one (before it writes past them)."""
        last = self._last_of_rank.get(rank)
        if last is not None:
            self.show_through(last)

    def show_older_than(self, cutoff: float) -> None:
        """Show the lines that have waited since before ``cutoff``."""
        while self._queue and self._queue[0].since <= cutoff:
            self._show_first()

    def oldest(self) -> float | None:
        """When the longest-waiting line came, or None when none waits."""
        return self._queue[0].since if self._queue else None

    def _show_first(self) -> None:
        line = self._queue.popleft()
        twins = self._by_text[line.text]
        twins.remove(line)
        if not twins:
            del self._by_text[line.text]
        for rank in line.ranks:
            if self._last_of_rank.get(rank) is line:
                del self._last_of_rank[rank]
        self._show(rank_tag(line.ranks) + line.text)


@dataclass
class _Unfinished:
    """What one rank wrote to one stream after its last newline."""

    held: bytes = b""
    since: float = 0.0
    shown_part: bool = False


class MergingConsole:
    """The console of ``console="all"``: each line once, tagged with the ranks that printed it.
    Not thread-safe: :class:`OutputRelay` calls it with its lock held."""

    def __init__(self, show: Show, wait_s: float = MERGE_WAIT_S) -> None:
        self.wait_s = wait_s
        self.ranks: set[int] = set()
        self._show = show
        self._waiting = {
            is_stderr: _WaitingLines(functools.partial(self._show_whole_line, is_stderr)) for is_stderr in (False, True)
        }
        self._unfinished: dict[tuple[int, bool], _Unfinished] = collections.defaultdict(_Unfinished)
        self._open_line: dict[bool, tuple[int, bool]] = {}  # per stream: (rank, ends in \r) of the open line

    def take(self, rank: int, chunk: bytes, is_stderr: bool, now: float) -> None:
        """Take ``chunk`` of what ``rank`` wrote to stdout or stderr, arrived at ``now``."""
        self.ranks.add(rank)
        state = self._unfinished[(rank, is_stderr)]
        *lines, rest = (state.held + chunk).split(b"\n")
        if lines or not state.held:
            state.since = now
        state.held = b""
        for line in (text + b"\n" for text in lines):
            if state.shown_part or b"\r" in line:
                self._show_raw(rank, is_stderr, line, state)
            else:
                self._waiting[is_stderr].add(rank, line, self.ranks, now)
        if b"\r" in rest or state.shown_part:
            self._show_raw(rank, is_stderr, rest, state)
        else:
            state.held = rest
        self.show_due(now)

    def _show_raw(self, rank: int, is_stderr: bool, text: bytes, state: _Unfinished) -> None:
        """Show ``text`` of ``rank`` as it is (after its waiting lines), tagged if it starts a line."""
        if not text:
            return
        self._waiting[is_stderr].show_rank(rank)
        self._end_open_line(is_stderr, unless=rank)
        self._show(text if state.shown_part else rank_tag({rank}) + text, is_stderr)
        state.shown_part = not text.endswith(b"\n")
        if state.shown_part:
            self._open_line[is_stderr] = (rank, text.endswith(b"\r"))
        else:
            self._open_line.pop(is_stderr, None)

    def _show_whole_line(self, is_stderr: bool, text: bytes) -> None:
        self._end_open_line(is_stderr)
        self._show(text, is_stderr)

    def _end_open_line(self, is_stderr: bool, unless: int | None = None) -> None:
        """Before other text: end the terminal's line where another rank's unfinished text (a
        progress bar, a line without its newline yet) stands, so nothing runs into it (after a
        ``\r`` the cursor is at the line's start already: the next line overwrites the bar, as
        on any terminal); that rank's next text starts with its tag again."""
        open_line = self._open_line.get(is_stderr)
        if open_line is None or open_line[0] == unless:
            return
        owner, at_line_start = open_line
        if not at_line_start:
            self._show(b"\n", is_stderr)
        self._unfinished[(owner, is_stderr)].shown_part = False
        del self._open_line[is_stderr]

    def show_due(self, now: float) -> None:
        """Show what has waited ``wait_s`` by ``now``."""
        cutoff = now - self.wait_s
        for (rank, is_stderr), state in self._unfinished.items():
            if state.held and state.since <= cutoff:
                self._show_raw(rank, is_stderr, state.held, state)
                state.held = b""
        for waiting in self._waiting.values():
            waiting.show_older_than(cutoff)

    def next_due(self) -> float | None:
        """When something held will be due (None when nothing is held)."""
        times = [state.since for state in self._unfinished.values() if state.held]
        times += [since for since in (waiting.oldest() for waiting in self._waiting.values()) if since is not None]
        return min(times) + self.wait_s if times else None

    def show_all(self) -> None:
        """Show everything held (the ranks are done writing)."""
        for waiting in self._waiting.values():
            waiting.show_through(None)
        for (rank, is_stderr), state in self._unfinished.items():
            if state.held:
                self._show_raw(rank, is_stderr, state.held, state)
                state.held = b""


def rank_tag(ranks: set[int]) -> bytes:
    """``[rank 2] `` or ``[ranks 0-3,5] ``: the console prefix of a line ``ranks`` printed."""
    if len(ranks) == 1:
        return f"[rank {next(iter(ranks))}] ".encode()
    return f"[ranks {rank_span(ranks, separator=',')}] ".encode()


def _newline_pieces(chunk: bytes) -> list[bytes]:
    """``chunk`` cut after each ``\n`` (``splitlines`` would cut at ``\r`` too)."""
    parts = chunk.split(b"\n")
    return [part + b"\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
