"""Where workers' printed output goes: every rank's stdout and stderr into its own log file,
and the chosen ranks' output to the driver's console as well."""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import IO, Literal

from lockstep._internal.progress import around_output

ConsoleMode = Literal["rank0", "all", "none"]
CONSOLE_MODES: tuple[ConsoleMode, ...] = ("rank0", "all", "none")
TAIL_LINES = 20


class OutputRelay:
    """Copies each worker's output, as it comes (progress bars included), to
    ``<log_dir>/rank_<r>.log`` and, for the shown ranks, to this process's stdout/stderr; with
    ``console="all"`` each console line is prefixed with its rank."""

    def __init__(self, log_dir: str, console: ConsoleMode) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.console = console
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._files: dict[int, IO[bytes]] = {}
        self._stderr_tails: dict[int, collections.deque[bytes]] = {}
        self._at_line_start: dict[tuple[int, bool], bool] = {}

    def log_path(self, rank: int) -> str:
        """The log file of ``rank``."""
        return os.path.join(self.log_dir, f"rank_{rank}.log")

    def attach(self, rank: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        """Start copying one rank's two streams (pipes from its process)."""
        with self._lock:
            self._log_file(rank)
        for stream, is_stderr in ((stdout, False), (stderr, True)):
            thread = threading.Thread(
                target=self._copy, args=(rank, stream, is_stderr), daemon=True, name=f"lockstep-output-rank{rank}",
            )
            thread.start()
            self._threads.append(thread)

    def _copy(self, rank: int, stream: IO[bytes], is_stderr: bool) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            self.write(rank, chunk, is_stderr)
        stream.close()

    def write(self, rank: int, chunk: bytes, is_stderr: bool) -> None:
        """Take ``chunk`` of what ``rank`` wrote: into its log, and to the console if shown."""
        with self._lock:
            log = self._log_file(rank)
            log.write(chunk)
            log.flush()
            if is_stderr:
                self._stderr_tails[rank].extend(chunk.splitlines(keepends=True))
            if self._shown(rank):
                self._to_console(rank, chunk, is_stderr)

    def _log_file(self, rank: int) -> IO[bytes]:
        """``rank``'s open log file (created on first use; call with the lock held)."""
        if rank not in self._files:
            self._files[rank] = open(self.log_path(rank), "ab")  # noqa: SIM115 - closed in close()
            self._stderr_tails[rank] = collections.deque(maxlen=TAIL_LINES)
        return self._files[rank]

    def _shown(self, rank: int) -> bool:
        return self.console == "all" or (self.console == "rank0" and rank == 0)

    def _to_console(self, rank: int, chunk: bytes, is_stderr: bool) -> None:
        console = sys.stderr if is_stderr else sys.stdout
        prefix = f"(rank {rank}) ".encode() if self.console == "all" else b""
        stream = (rank, is_stderr)
        text, self._at_line_start[stream] = _prefixed(chunk, prefix, self._at_line_start.get(stream, True))
        with around_output(ends_line=text.endswith(b"\n")):
            console.buffer.write(text) if hasattr(console, "buffer") else console.write(text.decode(errors="replace"))
            console.flush()

    def stderr_tail(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr."""
        return b"".join(self._stderr_tails.get(rank, ())).decode(errors="replace")

    def tail_with_log_path(self, rank: int) -> str:
        """The last lines ``rank`` wrote to stderr, then where its full log is."""
        tail = self.stderr_tail(rank).rstrip()
        where = f"(full output: {self.log_path(rank)})"
        return f"{tail}\n{where}" if tail else where

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait for the streams to end (their processes are gone) and close the log files."""
        for thread in self._threads:
            thread.join(timeout_s)
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()


def _prefixed(chunk: bytes, prefix: bytes, at_line_start: bool) -> tuple[bytes, bool]:
    """``chunk`` with ``prefix`` at the start of each line; and whether it ended a line."""
    if not prefix:
        return chunk, chunk.endswith(b"\n")
    lines = chunk.splitlines(keepends=True)
    text = b"".join((prefix + line) if (index > 0 or at_line_start) else line for index, line in enumerate(lines))
    return text, chunk.endswith(b"\n")
