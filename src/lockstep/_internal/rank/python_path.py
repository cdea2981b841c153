"""The import path a worker needs to import what the driver imports."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from lockstep._internal.installed import installed_file


def user_python_path() -> list[str]:
    """The driver's import path entries that a fresh interpreter would not have (the script's
    folder, entries added by the user), so workers can import the same modules."""
    entries = [os.path.abspath(entry or os.getcwd()) for entry in sys.path]
    return [entry for entry in dict.fromkeys(entries) if not installed_file(entry)]


def worker_pythonpath(env: Mapping[str, str]) -> str:
    """``PYTHONPATH`` for a worker whose environment is otherwise ``env``: the driver's own
    entries first, then what ``env`` had."""
    return os.pathsep.join(user_python_path() + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
