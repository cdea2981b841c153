"""``lockstep start-hook [install|remove|status]``: the command-line side of
:mod:`lockstep._internal.start_hook`."""

from __future__ import annotations

import argparse
from typing import Any

from lockstep._internal import start_hook

__all__ = ["add_start_hook_command", "start_hook_command"]

START_HOOK_HELP = """\
`python train.py` starts lockstep's warm worker process when the script imports lockstep,
usually after its own `import torch`. The start hook starts it before the script's first line,
as `lockstep run train.py` does: one .pth file in this Python's site-packages, whose line runs at
every start of this Python and imports lockstep early only for a .py script that names lockstep.
LOCKSTEP_WARM_START=0 still turns the warm start off. Without an action: whether it is installed.
"""

_ADVICE = {"absent": "", "installed": "", "outdated": " (another lockstep version wrote it: install again)"}


def add_start_hook_command(commands: Any) -> None:
    """The ``start-hook`` subcommand's arguments."""
    hook = commands.add_parser(
        "start-hook",
        help="install (or remove) a hook that starts the warm workers before a script's first line",
        description=START_HOOK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    hook.add_argument("action", nargs="?", choices=["install", "remove", "status"], default="status")


def start_hook_command(action: str) -> int:
    """Do ``action`` and print what was done; returns the exit status (an unwritable
    site-packages raises OSError, which the command reports)."""
    if action == "install":
        print(f"installed {start_hook.install()}")
    elif action == "remove":
        removed = start_hook.remove()
        print(f"removed {removed}" if removed else f"no start hook at {start_hook.hook_path()}")
    else:
        state = start_hook.hook_state()
        print(f"{state}: {start_hook.hook_path()}{_ADVICE[state]}")
    return 0
