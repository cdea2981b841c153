"""Helpers of tests/test_storage_faults.py: a small filesystem that fills up (tmpfs), mounted
for a test and always unmounted, and a closed port (connections to it are refused)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def mount_unavailable_reason() -> str | None:
    """Why a tmpfs can't be mounted here (None when it can)."""
    if os.geteuid() != 0:
        return "mounting a small filesystem needs root"
    return None


@contextmanager
def small_filesystem(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"5m"``) mounted on ``folder`` for the ``with`` block; unmounted after,
    whatever happens (lazily if something still holds it)."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=True)


def resize(folder: Path, size: str) -> None:
    """Give the tmpfs mounted on ``folder`` a new size (its files stay)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (just released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
