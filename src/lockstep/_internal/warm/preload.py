"""Which modules the warm process imports before it forks a ``fit()``'s workers (see
:mod:`lockstep._internal.warm.warm_start`): the installed packages the job needs, never the user's
own modules. Two lists: a guess made when the warm process starts, from the import statements of
the user's script (:func:`scan_script`), and at ``fit()`` the modules the job's pickle names
(:func:`preload_modules`)."""

from __future__ import annotations

import ast
import os
import re
import struct
import sys
from dataclasses import dataclass
from types import ModuleType

from lockstep._internal.installed import installed_file

#: How much of the payload is searched for module names (its pickle comes first).
SCANNED_PAYLOAD_BYTES = 16 << 20
#: Installed packages never imported in the warm process: they start threads or services.
NEVER_PRELOADED = frozenset({"ray", "pytest", "_pytest", "IPython", "ipykernel", "jupyter_client", "zmq", "tornado"})
#: What a job that calls ``prepare_model`` imports on every rank if the warm process has not:
#: DistributedDataParallel's constructor imports torch._dynamo (about 900 modules, 1.6 s of CPU
#: per process on a 2-core machine: 25 s of a 32-rank job's start when each rank does it).
FOR_PREPARED_MODELS = ("torch._dynamo",)
#: How many of the script's own modules (files beside it) are read for their imports, at most.
SCANNED_LOCAL_MODULES = 20


def preload_modules(payload: bytes) -> list[str]:
    """The installed modules (under this Python's prefixes) the driver has imported that the
    job needs, in import order: those its pickle names, and those that the user's own modules it
    names import (a train function calling ``mlp_common.load_data`` needs torchvision, which
    ``mlp_common`` imports). The user's own modules are left to the workers, so an edited file
    is read afresh at every ``fit()``."""
    names = set(re.findall(rb"[A-Za-z_][A-Za-z0-9_.]*", _pickle_of(payload)[:SCANNED_PAYLOAD_BYTES]))
    modules = list(sys.modules.items())
    for name, module in modules:
        if name.encode() in names and not _installed(module) and name != "__main__":
            names |= _imported_by(module)
    chosen = []
    for name, module in modules:
        if name.encode() not in names or not _may_preload(name):
            continue
        if _installed(module):
            chosen.append(name)
    if b"prepare_model" in names:
        chosen += [name for name in FOR_PREPARED_MODELS if name not in chosen]
    return chosen


def _installed(module: ModuleType) -> bool:
    """Whether ``module`` comes from this Python's installation (not the user's own files)."""
    origin = getattr(module, "__file__", None)
    return isinstance(origin, str) and installed_file(origin)


def _imported_by(module: ModuleType) -> set[bytes]:
    """The names of the modules a (user's) module imported, or whose objects it holds."""
    found: set[bytes] = set()
    for value in list(vars(module).values()):
        name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str):
            found.add(name.encode())
    return found


def _pickle_of(payload: bytes) -> memoryview:
    """The pickle inside a payload (the tensors' bytes after it name no modules)."""
    from lockstep._internal.payload import MAGIC

    view = memoryview(payload)
    if not payload.startswith(MAGIC):
        return view
    length, tensors = struct.unpack_from("<QQ", payload, len(MAGIC))
    start = len(MAGIC) + 16 + 16 * tensors
    return view[start : start + length]


@dataclass(frozen=True)
class ScriptScan:
    """What a user's script (and its own modules beside it) says about the run it will start."""

    #: The installed modules it imports, top-level statements first: a guess of what its workers
    #: need, imported by the warm process while the script runs its own imports (names outside
    #: this Python's installation are dropped there; standard-library, lockstep's and
    #: never-preloaded ones here).
    modules: list[str]
    #: Whether it names one of lockstep's trainers: a script that only uses lockstep's other
    #: modules (a tool, a benchmark's scripted ranks) gets no warm process at ``import lockstep``.
    builds_trainer: bool


#: Names whose presence in a script says it will call ``fit()`` on this machine, likely.
TRAINER_NAMES = (b"TorchTrainer", b"DataParallelTrainer")


def scan_script(script: str) -> ScriptScan:
    """Read the script at ``script`` and the modules beside it that it imports (at most
    :data:`SCANNED_LOCAL_MODULES`); unreadable or unparsable files say nothing."""
    folder = os.path.dirname(os.path.abspath(script))
    found: list[str] = []
    builds_trainer = False
    queue, seen = [os.path.abspath(script)], set[str]()
    while queue and len(seen) < SCANNED_LOCAL_MODULES:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            with open(path, "rb") as source:
                text = source.read()
            tree = ast.parse(text, filename=path)
        except (OSError, SyntaxError, ValueError):
            continue
        for name in _imported_names(tree):
            top = name.partition(".")[0]
            local = os.path.join(folder, top + ".py")
            if os.path.isfile(local):
                queue.append(local)
            elif os.path.isdir(os.path.join(folder, top)):
                continue  # the user's package beside the script (maybe shadowing an installed one): workers import it
            elif _may_preload(name):
                found.append(name)
        if b"prepare_model" in text:
            found += FOR_PREPARED_MODELS
        builds_trainer = builds_trainer or any(name in text for name in TRAINER_NAMES)
    return ScriptScan(list(dict.fromkeys(found)), builds_trainer)


def _imported_names(tree: ast.AST) -> list[str]:
    """The absolute module names a module's import statements name (anywhere in it)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _may_preload(name: str) -> bool:
    top = name.partition(".")[0]
    return not (
        top in sys.stdlib_module_names
        or top in NEVER_PRELOADED
        or top == "lockstep"
        or top == "__future__"
        or any(part.startswith("_") for part in name.split("."))
    )
