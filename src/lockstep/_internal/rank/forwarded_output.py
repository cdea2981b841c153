"""A rank's output sent to the driver over its channel, for ranks whose stdout and stderr the
driver can't read as pipes (a Ray actor's, or a rank forked on a Ray node)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

from lockstep._internal.wire import protocol
from lockstep._internal.wire.channel import WorkerChannel

__all__ = ["ENV_FORWARD_OUTPUT", "ForwardedOutput"]

#: Set to 1 in a rank's environment: the worker process sends its output over its channel.
ENV_FORWARD_OUTPUT = "LOCKSTEP_FORWARD_OUTPUT"


class ForwardedOutput:
    """While active, what this process writes to its stdout and stderr (Python's and C's alike)
    goes to the driver as :class:`~lockstep._internal.wire.protocol.Output` messages instead of to
    Ray's log files, so the driver treats it as it treats a local worker's output."""

    def __init__(self, channel: WorkerChannel, rank: int) -> None:
        self.channel = channel
        self.rank = rank
        self._saved: dict[int, int] = {}
        self._readers: list[threading.Thread] = []

    def __enter__(self) -> ForwardedOutput:
        _flush_python_streams()
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
        for fd in (1, 2):
            read_end, write_end = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write_end, fd)
            os.close(write_end)
            reader = threading.Thread(
                target=self._forward, args=(read_end, fd == 2), daemon=True, name=f"lockstep-forward-fd{fd}"
            )
            reader.start()
            self._readers.append(reader)
        return self

    def _forward(self, read_end: int, is_stderr: bool) -> None:
        try:
            while chunk := os.read(read_end, 65536):
                self.channel.send(protocol.Output(self.rank, is_stderr, chunk))
        except OSError:
            pass  # the driver is gone; nothing left to tell it
        finally:
            os.close(read_end)

    def __exit__(self, *exc_info: object) -> None:
        """Put the streams back; wait (briefly: data-loader processes may still hold them) until
        everything written has been sent."""
        _flush_python_streams()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        for reader in self._readers:
            reader.join(OUTPUT_DRAIN_S)


OUTPUT_DRAIN_S = 5.0


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
