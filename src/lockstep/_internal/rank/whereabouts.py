"""Where a rank is, told from inside its process: the Python stacks of its threads, and the
torch.distributed collective it waits in, as torch's flight recorder knows it.

The flight recorder (``TORCH_FR_BUFFER_SIZE`` entries per process, read when the process group
is created) keeps the process's recent collectives; one not yet retired (gloo) or completed
(NCCL) is the one the rank waits in. lockstep turns it on for its ranks while the hang detector
is on (:func:`default_flight_recorder`), unless the environment sets it already (0: off).
"""

from __future__ import annotations

import json
import linecache
import os
import re
import sys
import sysconfig
import threading
import traceback
from typing import Any

__all__ = [
    "collective_in_flight",
    "default_flight_recorder",
    "dump_without_plumbing",
    "python_stacks",
    "with_source_lines",
]

FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: The flight recorder's entries per process when lockstep turns it on.
FLIGHT_RECORDER_ENTRIES = 100
#: Frames of lockstep (its public calls too: ``fit()`` under torchrun, ``report()``), of socket
#: reads and of thread start-up are plumbing, not the user's code.
PLUMBING = (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,
    "<frozen runpy>",
    "/multiprocessing/connection.py",
    "in _bootstrap",
)
_LIBRARY_PATHS = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], "site-packages"})

#: The same, as they show in a faulthandler dump of a rank asked from outside (SIGUSR1).
DUMP_PLUMBING = ("/lockstep/_internal/", "<frozen runpy>", "/multiprocessing/connection.py")


def dump_without_plumbing(stack: str) -> str:
    """A faulthandler dump without the frames of lockstep's worker runtime and socket reads, and
    without the threads that have no other frames than those and ``threading.py``'s (lockstep's
    own threads, idle)."""
    blocks = []
    for block in stack.split("\n\n"):
        lines = [line for line in block.splitlines() if not any(part in line for part in DUMP_PLUMBING)]
        frames = [line for line in lines if line.lstrip().startswith("File ")]
        if any("/threading.py" not in line for line in frames) or "File " not in block:
            blocks.append("\n".join(lines))
    return "\n\n".join(block for block in blocks if block)


def with_source_lines(dump: str) -> str:
    """A faulthandler dump with each frame's source line below it, as a traceback shows it
    (read from the file where the dump is read: the same node)."""
    lines = []
    for line in dump.splitlines():
        lines.append(line)
        frame = _DUMP_FRAME.match(line)
        source = linecache.getline(frame["file"], int(frame["line"])).strip() if frame else ""
        if source:
            lines.append(f"    {source}")
    return "\n".join(lines)


_DUMP_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in ')


def default_flight_recorder() -> None:
    """Turn torch's flight recorder on for process groups created from now on in this process,
    unless the environment already says what it wants."""
    if not any(name in os.environ for name in FLIGHT_RECORDER_VARIABLES):
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)


def python_stacks(train_thread: int | None) -> str:
    """The stacks of this process's threads, most recent call last, without lockstep's
    frames and threads: the train function's thread (``train_thread``) first, then any other
    thread that is in code outside the standard library and installed packages."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: ident != train_thread)
    parts = []
    for ident in order:
        name = names.get(ident, str(ident))
        if name.startswith("lockstep-"):
            continue
        entries = [entry for entry in traceback.format_stack(frames[ident]) if not _is_plumbing(entry)]
        if entries and (ident == train_thread or any(not _in_library(entry) for entry in entries)):
            parts.append(f"Thread {name} (most recent call last):\n{''.join(entries)}")
    return "\n".join(parts)


def _is_plumbing(entry: str) -> bool:
    first_line = entry.splitlines()[0]
    return any(part in first_line for part in PLUMBING)


def _in_library(entry: str) -> bool:
    first_line = entry.splitlines()[0]
    return any(path in first_line for path in _LIBRARY_PATHS)


def collective_in_flight() -> tuple[str | None, bool]:
    """The collective this process waits in (described for humans) and whether that is known
    at all (the flight recorder is on and a process group exists)."""
    if not _flight_recorder_on():
        return None, False
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None, False
        entries = _recorded_entries()
    except Exception:  # noqa: BLE001 - a diagnostic: an older torch or a backend without it
        return None, False
    waiting = [entry for entry in entries if not entry.get("retired") and entry.get("state") != "completed"]
    if not waiting:
        return None, True
    return describe_entry(max(waiting, key=lambda entry: entry.get("time_created_ns", 0))), True


def _flight_recorder_on() -> bool:
    for name in FLIGHT_RECORDER_VARIABLES:
        if name in os.environ:
            return os.environ[name].strip().isdigit() and int(os.environ[name]) > 0
    return False


def _recorded_entries() -> list[dict[str, Any]]:
    """The flight recorder's entries: the generic one's (gloo and others) and, in a CUDA build,
    the NCCL one's."""
    from torch._C import _distributed_c10d as c10d

    entries: list[dict[str, Any]] = []
    for dump in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump_fn = getattr(c10d, dump, None)
        if dump_fn is None:
            continue
        try:
            entries += json.loads(dump_fn(includeCollectives=True, onlyActive=True)).get("entries", [])
        except Exception:  # noqa: BLE001, S112 - this recorder has nothing (no NCCL group, no CUDA)
            continue
    return entries


def describe_entry(entry: dict[str, Any]) -> str:
    """A flight recorder entry for humans: the collective, its sequence number, its process
    group, its tensors' sizes and its state."""
    group = entry.get("process_group") or ["?", "?"]
    group_name = group[1] if isinstance(group, list) and len(group) > 1 else group
    return (
        f"{entry.get('profiling_name', '?')} #{entry.get('collective_seq_id', '?')} on process group {group_name} "
        f"(input sizes {entry.get('input_sizes', '?')}, {entry.get('state', '?')})"
    )
