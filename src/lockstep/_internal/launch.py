"""``lockstep run SCRIPT [ARGS...]``: run a training script as ``python SCRIPT ARGS...`` would,
with its warm worker process started before the script's first line.

A script that imports torch (and torchvision) before lockstep gives lockstep control only after
those imports; the warm process then imports torch again before the workers can start. Started
here instead, it imports torch and the packages the script imports beside the script's own
imports. The script runs in this process as ``__main__`` (its arguments in ``sys.argv``, its
folder first on ``sys.path``); its exceptions and exit status are its own.
"""

from __future__ import annotations

import builtins
import io
import os
import sys
from collections.abc import Sequence
from types import ModuleType, TracebackType

__all__ = ["run_script"]


def run_script(script: str, arguments: Sequence[str]) -> int:
    """Start the warm process for ``script``, then run it as the main module; the exit status
    (1 when it raised: its traceback is printed from the script's frame on, as Python does).

    Raises:
        FileNotFoundError: ``script`` is not a file.
    """
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no script at {script!r}: give the path of a Python file, as to `python`")
    from lockstep._internal.fast_exit import end_without_last_collections
    from lockstep._internal.warm import warm_start
    from lockstep._internal.warm.preload import scan_script

    if warm_start.warm_process_pid() is None:  # else `import lockstep` started it for this script already
        warm_start.start_in_background(scan_script(path).modules)
    folder = os.path.dirname(os.path.realpath(path))  # as Python: a symlinked script's own folder
    end_without_last_collections(folder)
    sys.argv = [script, *arguments]
    sys.path[0] = folder
    try:
        _run_as_main(path)
    except SystemExit as stop:
        stop.__traceback__ = None  # its frames would hold the script's globals past the exit's collection
        raise
    except Exception as error:  # noqa: BLE001 - shown as `python SCRIPT` shows it
        trace = _from_script(error.__traceback__, path)
        if trace is error.__traceback__ and isinstance(error, SyntaxError) and error.filename == path:
            trace = None  # the script does not compile: Python shows the error alone
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        return 1
    return 0


def _run_as_main(path: str) -> None:
    """Run the script at ``path`` as the ``__main__`` module, which stays in ``sys.modules`` until
    the interpreter's teardown (as under ``python SCRIPT``: its objects live as long)."""
    module = ModuleType("__main__")
    module.__dict__.update(
        __file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None, __builtins__=builtins
    )
    sys.modules["__main__"] = module
    with io.open_code(path) as handle:
        code = compile(handle.read(), path, "exec", dont_inherit=True)  # not this module's __future__ flags
    exec(code, module.__dict__)  # the user's script, as Python runs it


def _from_script(trace: TracebackType | None, path: str) -> TracebackType | None:
    """``trace`` without the launcher's frames (those before the script's first)."""
    found = trace
    while found is not None and found.tb_frame.f_code.co_filename != path:
        found = found.tb_next
    return found or trace
