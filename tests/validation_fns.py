"""The validation functions of tests/test_validation.py, in a module that imports no torch: a
validation process imports the module of its function, and these tests start a dozen of them."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from lockstep import Checkpoint

WAIT_S = 60


def wait_for(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    """Return once ``condition()`` is true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.02)


def read_value(checkpoint: Checkpoint) -> float:
    with checkpoint.as_directory() as folder:
        return float(Path(folder, "value.txt").read_text())


def validate_value(checkpoint: Checkpoint) -> dict[str, Any]:
    return {"val": read_value(checkpoint), "pid": os.getpid(), "threads": os.environ.get("OMP_NUM_THREADS")}


def validate_as_told(checkpoint: Checkpoint, marks: str, scale: float = 1.0, mode: str = "ok") -> dict[str, Any]:
    """"wait": say when it started and wait for the train function's go; "fail" raises; "hang"
    never returns."""
    if mode == "wait":
        Path(marks, "started").touch()
        wait_for(Path(marks, "go").exists, "the train function's go")
        Path(marks, "finished").touch()
    if mode == "fail":
        raise ValueError("this checkpoint is no good")
    if mode == "hang":
        threading.Event().wait()
    return {"val": read_value(checkpoint) * scale, "scale": scale}


def validate_at_once(checkpoint: Checkpoint, marks: str) -> dict[str, Any]:
    return {"val": 7, "step": int(Path(checkpoint.path, "step.txt").read_text())}
