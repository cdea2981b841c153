"""The private copy an ASYNC checkpoint upload works from (the user may delete or rewrite their
folder as soon as ``report()`` returns): hard links beside the user's folder when the filesystem
allows them, else a copy in the temporary folder.

A rank killed during its upload (SIGKILL, the OOM killer, a lost machine) leaves its copy
behind. Each copy's name carries the host and process that made it
(``.lockstep_upload_<host>_<pid>_<random>``), and the first time a process stages into a folder
it removes the copies there of this host's processes that no longer exist. Copies of other hosts
(a folder on a shared filesystem) are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile

PREFIX = ".lockstep_upload_"
_swept: set[str] = set()


def _host_prefix() -> str:
    return f"{PREFIX}{socket.gethostname()}_"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep_abandoned(parent: str) -> list[str]:
    """Remove the staging copies in ``parent`` made by processes of this host that are gone;
    return their paths."""
    prefix = _host_prefix()
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[len(prefix) :].split("_", 1)[0] if name.startswith(prefix) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            path = os.path.join(parent, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _staging_folder(parent: str | None) -> str:
    """A new empty staging folder in ``parent`` (None: the temporary folder), swept first."""
    where = parent if parent is not None else tempfile.gettempdir()
    if where not in _swept:
        _swept.add(where)
        sweep_abandoned(where)
    return tempfile.mkdtemp(prefix=f"{_host_prefix()}{os.getpid()}_", dir=where)


def private_copy(folder: str) -> str:
    """A copy of ``folder`` that survives its deletion: hard links beside it when possible, else
    a copy in the temporary folder."""
    staged = None
    try:
        staged = _staging_folder(os.path.dirname(os.path.abspath(folder)))
        shutil.copytree(folder, staged, copy_function=os.link, dirs_exist_ok=True)
    except OSError:
        if staged is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(staged)
        staged = _staging_folder(None)
        shutil.copytree(folder, staged, dirs_exist_ok=True)
    return staged
