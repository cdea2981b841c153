"""Reading many ranks' output pipes with one thread.

A rank started on this machine writes its stdout and stderr into two pipes whose other ends the
driver holds. One :class:`PipeReader` waits on all of them at once (``epoll``), so a group of
1,000 ranks costs one thread, not 2,000, and a rank never blocks on output while the driver
reads (a pipe holds 64 KiB).
"""

from __future__ import annotations

import os
import selectors
import threading
from collections.abc import Callable
from typing import IO, Any


class PipeReader:
    """One thread that reads many ranks' output pipes as their bytes come, whatever their
    number, and hands each chunk to ``take(rank, chunk, is_stderr)``; a pipe is closed at its end."""

    def __init__(self, take: Callable[[int, bytes, bool], None]) -> None:
        self._take = take
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._added: list[tuple[IO[bytes], int, bool]] = []
        self._open = 0
        self._state = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="lockstep-output")
        self._thread.start()

    def add(self, rank: int, stream: IO[bytes], is_stderr: bool) -> None:
        """Read ``stream`` (a pipe) for ``rank`` until its end."""
        with self._state:
            self._added.append((stream, rank, is_stderr))
            self._open += 1
        os.write(self._wake_write, b"+")

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select():
                if key.data is None:
                    self._take_added()
                else:
                    self._read(key.fileobj, *key.data)
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _take_added(self) -> None:
        os.read(self._wake_read, 4096)
        with self._state:
            added, self._added = self._added, []
        for stream, rank, is_stderr in added:
            self._selector.register(stream, selectors.EVENT_READ, (rank, is_stderr))

    def _read(self, stream: Any, rank: int, is_stderr: bool) -> None:
        try:
            chunk = os.read(stream.fileno(), 65536)
        except OSError:
            chunk = b""
        if chunk:
            self._take(rank, chunk, is_stderr)
            return
        self._selector.unregister(stream)
        stream.close()
        with self._state:
            self._open -= 1
            self._state.notify_all()

    def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every pipe to end, then stop the thread."""
        with self._state:
            self._state.wait_for(lambda: self._open == 0, timeout_s)
        self._stopping = True
        os.write(self._wake_write, b"!")
        self._thread.join(timeout_s)
        os.close(self._wake_write)
        os.close(self._wake_read)
