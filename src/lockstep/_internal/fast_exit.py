"""A faster end for ``lockstep run``: Python's exit without its walks over torch's objects.

When a script that imported torch ends, Python spends most of its exit tearing down the hundreds
of thousands of objects that its imports made, with several full collections of garbage on the
way (on 2 CPUs with torch and torchvision loaded, the exit takes about 0.6 s, and about 0.3 s with
the step below). ``lockstep run`` shortens it. After the script's non-daemon threads have ended and its
exit handlers have run, one step:

1. every open buffered file is flushed (one that an installed package keeps open is never
   closed below);
2. the script's own modules (``__main__`` and the modules from its folder) leave ``sys.modules``,
   and one full collection releases and finalizes what they alone held, their globals still set
   while the finalizers run (as in Python's teardown); the globals of a module that an installed
   package still holds something of (a function, a class) are then set to None, as Python's
   teardown does, which releases what only they held;
3. everything still alive (the installed packages' objects, torch's) is moved into the
   collector's permanent generation (:func:`gc.freeze`), so the teardown's collections skip it
   and the operating system reclaims it with the process.

What no longer happens: an object that only the teardown of an installed package would release
is not finalized (a buffered file it holds was flushed before). ``logging`` is shut down first
(its handlers may be the script's), and what the clearing of a held module's globals releases
is collected before the freeze. While a thread other than an installed package's or lockstep's
still runs (it may run the script's code), the step is skipped and Python's own exit runs. ``LOCKSTEP_FAST_EXIT=0``
keeps Python's own exit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import io
import logging
import os
import sys
import threading
import weakref
from types import ModuleType
from typing import Any

from lockstep._internal.installed import installed_file
from lockstep._internal.switches import switched_on

__all__ = ["ENV_FAST_EXIT", "end_without_last_collections"]

ENV_FAST_EXIT = "LOCKSTEP_FAST_EXIT"
_BUFFERED = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def end_without_last_collections(script_folder: str) -> bool:
    """Arrange for this process's exit to take the shorter way above (unless ``LOCKSTEP_FAST_EXIT``
    is 0, false or off), ``script_folder`` being where the script's own modules are; whether it
    did. Call it before the script runs: the step runs after every exit handler registered later."""
    if not switched_on(ENV_FAST_EXIT):
        return False
    atexit.register(_end_shortly, os.path.abspath(script_folder))
    return True


def _end_shortly(script_folder: str) -> None:
    atexit.unregister(logging.shutdown)  # its exit handler would come after this one, and run twice
    logging.shutdown()
    names = _script_modules(script_folder)
    if _runs_in_a_thread(names):
        return
    _flush_open_files()
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):  # a traceback holds the script's frames
        if hasattr(sys, name):
            setattr(sys, name, None)
    probes = []
    for name in names:
        probes.append(weakref.ref(_Probe(vars(sys.modules.pop(name)))))
    sys.modules["__main__"] = ModuleType("__main__")
    gc.collect()  # the script's modules that nothing else holds go, their globals set for finalizers
    cleared = False
    for probe in probes:
        held = probe()
        if held is not None:  # an installed package still holds something of it: clear it as Python would
            _clear(held.names)
            cleared = True
    if cleared:
        gc.collect()  # what only those globals held (cycles included) is finalized before the freeze
    gc.freeze()


class _Probe:
    """Put in a module's globals: alive after a collection only if those globals are."""

    def __init__(self, names: dict[str, Any]) -> None:
        self.names = names
        names["__lockstep_exit_probe__"] = self


def _clear(names: dict[str, Any]) -> None:
    """Set a module's names to None as Python's teardown does: ``_private`` names first."""
    for private_first in (True, False):
        for name in list(names):
            if name != "__builtins__" and name.startswith("_") == private_first:
                names[name] = None


def _script_modules(script_folder: str) -> list[str]:
    """``__main__`` and the imported modules whose file is in the script's folder (not an
    installed package's, not lockstep's)."""
    inside = script_folder.rstrip(os.sep) + os.sep
    found = []
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        path = os.path.abspath(origin) if isinstance(origin, str) else ""
        if name == "__main__" or (
            path.startswith(inside) and not installed_file(path) and name.split(".")[0] != "lockstep"
        ):
            found.append(name)
    return found


def _runs_in_a_thread(names: list[str]) -> bool:
    """Whether a thread still runs (a daemon thread) that is not an installed package's: it may
    run code of the script's modules (``names``; through a partial, a bound method, anything),
    and clearing their globals under it would break it, so Python's own exit is kept then."""
    for thread in threading.enumerate():
        if thread is threading.current_thread():
            continue
        target = getattr(thread, "_target", None)
        while isinstance(target, functools.partial):
            target = target.func
        where = getattr(target, "__module__", None) if target is not None else type(thread).__module__
        if where in names or not _installed_module(where):
            return True
    return False


def _installed_module(name: Any) -> bool:
    """Whether module ``name`` is an installed package's, or lockstep's (its threads never run
    the script's code)."""
    if isinstance(name, str) and name.split(".")[0] == "lockstep":
        return True
    module = sys.modules.get(name) if isinstance(name, str) else None
    origin = getattr(module, "__file__", None)
    return isinstance(origin, str) and installed_file(os.path.abspath(origin))


def _flush_open_files() -> None:
    for item in gc.get_objects():
        if issubclass(type(item), _BUFFERED):
            with contextlib.suppress(Exception):  # closed, detached, or a reader that went away
                if not item.closed:
                    item.flush()
