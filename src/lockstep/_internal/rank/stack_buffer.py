"""Where a rank writes its Python stacks when asked (SIGUSR1: faulthandler's dump of every
thread): an in-memory file (``memfd``) made by whoever asks (the driver, or on a Ray node the
rank's actor) and inherited by the rank, which reads it back. It has no name in any folder, so a
driver or actor killed mid-run leaves nothing behind in the temporary folder."""

from __future__ import annotations

import os

__all__ = ["ENV_STACK_FD", "dump_size", "new_stack_buffer", "read_dump"]

#: The rank's environment names the descriptor (in the rank's process) of its stack buffer.
ENV_STACK_FD = "LOCKSTEP_STACK_FD"
_READ_CHUNK = 1 << 16


def new_stack_buffer() -> int:
    """An empty in-memory file for a rank's dumps (close-on-exec: hand it on explicitly)."""
    return os.memfd_create("lockstep-stacks")


def dump_size(fd: int) -> int:
    """How many bytes of dumps ``fd`` holds so far."""
    return os.fstat(fd).st_size


def read_dump(fd: int, start: int = 0) -> str:
    """What the rank wrote into ``fd`` from byte ``start`` on (reading moves no file offset, so
    the rank's next dump still goes after its last)."""
    chunks = []
    offset = start
    while chunk := os.pread(fd, _READ_CHUNK, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")
