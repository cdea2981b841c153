"""Which modules the warm process imports before it forks a ``fit()``'s workers (see
:mod:`lockstep._internal.warm_start`): the installed packages the job needs, never the user's
own modules."""

from __future__ import annotations

import os
import re
import struct
import sys

#: How much of the payload is searched for module names (its pickle comes first).
SCANNED_PAYLOAD_BYTES = 16 << 20
#: Installed packages never imported in the warm process: they start threads or services.
NEVER_PRELOADED = frozenset({"ray", "pytest", "_pytest", "IPython", "ipykernel", "jupyter_client", "zmq", "tornado"})


def preload_modules(payload: bytes) -> list[str]:
    """The installed modules (under this Python's prefixes) the driver has imported and the
    job's pickle names, in import order. The user's own modules are left to the workers, so
    an edited file is read afresh at every ``fit()``."""
    names = set(re.findall(rb"[A-Za-z_][A-Za-z0-9_.]*", _pickle_of(payload)[:SCANNED_PAYLOAD_BYTES]))
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    stdlib = sys.stdlib_module_names
    chosen = []
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top in stdlib or top in NEVER_PRELOADED or name.encode() not in names or top == "lockstep":
            continue
        if any(part.startswith("_") for part in name.split(".")) or name == "__main__":
            continue
        origin = getattr(module, "__file__", None)
        if origin and os.path.abspath(origin).startswith(prefixes):
            chosen.append(name)
    return chosen


def _pickle_of(payload: bytes) -> memoryview:
    """The pickle inside a payload (the tensors' bytes after it name no modules)."""
    from lockstep._internal.payload import MAGIC

    view = memoryview(payload)
    if not payload.startswith(MAGIC):
        return view
    length, tensors = struct.unpack_from("<QQ", payload, len(MAGIC))
    start = len(MAGIC) + 16 + 16 * tensors
    return view[start:start + length]
