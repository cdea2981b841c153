"""Start the warm process as soon as ``import lockstep`` runs in a user's script.

A script run as ``python train.py`` (or ``lockstep run train.py``) that imports lockstep (any of
its modules) and names one of its trainers (it, or its own modules beside it, e.g.
``TorchTrainer``) will likely call ``fit()``: its warm process (:mod:`lockstep._internal.warm.warm_start`)
starts then, so that it imports torch and the script's packages beside the script's own imports rather than after them.
Only the check lives here: importing lockstep anywhere else (``python -c``, ``python -m``, the
``lockstep`` command and its dashboard, workers, validation processes) imports nothing of the
warm start. ``LOCKSTEP_WARM_START=0`` turns it off; the warm start's own rules (nothing under
torchrun, in Ray workers, in ``multiprocessing`` children, off the main thread) still apply.
"""

from __future__ import annotations

import os
import sys

__all__ = ["start_for_script", "user_script"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_script() -> str | None:
    """The absolute path of the Python file this interpreter runs as its main script (or will
    run: ``lockstep run SCRIPT``), or None (``-c``, ``-m`` before the module runs, another
    console command, an interactive session, a file of lockstep's own)."""
    argv = sys.argv or [""]
    path = argv[0]
    if os.path.basename(path) == "lockstep" and argv[1:2] == ["run"] and len(argv) > 2:
        path = argv[2]
    if not path.endswith(".py") or not os.path.isfile(path):
        return None
    path = os.path.abspath(path)
    return None if path.startswith(_PACKAGE + os.sep) else path


def start_for_script() -> None:
    """Start the warm process for the script this interpreter runs, if it runs one that names
    one of lockstep's trainers (it, or its own modules beside it)."""
    script = user_script()
    if script is None:
        return
    from lockstep._internal.warm import warm_start
    from lockstep._internal.warm.preload import scan_script

    scan = scan_script(script)
    if scan.builds_trainer:
        warm_start.start_in_background(scan.modules)
