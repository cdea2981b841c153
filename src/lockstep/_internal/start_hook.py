"""The start hook: ``python train.py`` starts lockstep's warm process before the script's first line.

Without it, the warm process starts when the script imports lockstep, which scripts do after
``import torch`` (and torchvision): its own torch import then runs after the script's instead of
beside it (``lockstep run train.py`` has no such gap; see docs/cli.md). The hook is one ``.pth``
file in this Python's site-packages (``lockstep start-hook install``; ``remove`` takes it away).
Python runs its line at every interpreter start, before the main script; the line imports lockstep
only when the script is a ``.py`` file whose text names lockstep, and ``import lockstep`` then
runs its usual check (:mod:`lockstep._internal.early_warm`); such a script also ends as under
``lockstep run`` (``LOCKSTEP_FAST_EXIT=0`` keeps Python's own exit). Any other start pays a read of the
script's first MiB (``python -c``, ``-m``, the REPL and console commands: not even that).

The line cannot import lockstep to decide whether to import lockstep, so its check is plain
code carried in the ``.pth`` file, and a missing or broken lockstep is ignored there (the script's
own ``import lockstep`` then reports it).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Literal

__all__ = ["PTH_NAME", "HookState", "hook_path", "hook_state", "install", "pth_text", "remove"]

#: The file's name. Python reads site-packages' ``.pth`` files in name order: this one comes
#: after ``__editable__`` (an editable install) and any name starting with a digit or ``a``-``k``.
PTH_NAME = "lockstep-start-hook.pth"

#: What the ``.pth`` line runs, in a namespace of its own. Imports lockstep (once: Python may
#: read a venv's site-packages twice) when the main script is a regular .py file (not a pipe,
#: which the read would drain) naming lockstep and no ``lockstep`` of its own lies beside it,
#: and gives the script ``lockstep run``'s exit (:mod:`lockstep._internal.fast_exit`; its exit
#: step registered first, so it runs after every exit handler of the script).
_CHECK = """\
import os, sys
script = sys.argv[0] if sys.argv else ""
folder = os.path.dirname(os.path.abspath(script))
if ("lockstep" not in sys.modules and script.endswith(".py") and os.path.isfile(script)
        and not os.path.exists(os.path.join(folder, "lockstep"))
        and not os.path.exists(os.path.join(folder, "lockstep.py"))):
    try:
        with open(script, "rb") as source:
            named = b"lockstep" in source.read(1 << 20)
    except OSError:
        named = False
    if named:
        try:
            import lockstep
            from lockstep._internal.fast_exit import end_without_last_collections
            end_without_last_collections(folder)
        except Exception:
            pass
"""

#: "outdated": the file is there, written by another version of lockstep.
HookState = Literal["installed", "outdated", "absent"]


def pth_text() -> str:
    """The ``.pth`` file's content: one line, which Python executes because it starts with
    ``import``."""
    return f"import sys; exec({_CHECK!r}, {{'__name__': 'lockstep_start_hook'}})\n"


def hook_path(site_packages: str | None = None) -> Path:
    """Where the hook lives: ``site_packages`` or this Python's (its ``purelib``: a venv's own)."""
    return Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME


def hook_state(site_packages: str | None = None) -> HookState:
    """Whether the hook is installed in ``site_packages`` (default: this Python's), as this
    version of lockstep writes it."""
    path = hook_path(site_packages)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return "absent"
    return "installed" if text == pth_text() else "outdated"


def install(site_packages: str | None = None) -> Path:
    """Write the hook (replacing an older one) and return its path.

    Raises:
        OSError: site-packages can't be written (another user's Python: use a venv of your own).
    """
    path = hook_path(site_packages)
    partial = path.with_name(f".{PTH_NAME}.{os.getpid()}")
    partial.write_text(pth_text())
    os.replace(partial, path)  # Python starting meanwhile reads the old file or the new, whole
    return path


def remove(site_packages: str | None = None) -> Path | None:
    """Delete the hook; return the path it had, or None when none was installed."""
    path = hook_path(site_packages)
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return path
