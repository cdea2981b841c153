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
    return {
        "val": read_value(checkpoint),
        "pid": os.getpid(),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def validate_as_told(checkpoint: Checkpoint, marks: str, scale: float = 1.0, mode: str = "ok") -> dict[str, Any]:
    """ "wait": say when it started and wait for the train function's go; "fail" raises; "hang"
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


def validate_lightning_checkpoint(checkpoint: Checkpoint, name: str) -> dict[str, Any]:
    """The epoch and step that Lightning's checkpoint file says it holds."""
    import torch

    with checkpoint.as_directory() as folder:
        state = torch.load(os.path.join(folder, name), map_location="cpu", weights_only=False)
    return {"ckpt_epoch": state["epoch"], "ckpt_step": state["global_step"]}


def validate_in_ray_task(checkpoint: Checkpoint, mode: str = "ok") -> dict[str, Any]:
    """Where it ran (a Ray task on a test node), and the checkpoint's value; "fail" raises,
    "hang" runs past any timeout."""
    import ray

    if mode == "fail":
        raise ValueError("this checkpoint is no good")
    if mode == "hang":
        time.sleep(600)
    context = ray.get_runtime_context()
    return {
        "val": read_value(checkpoint),
        "node": os.environ.get("LOCKSTEP_TEST_NODE"),
        "in_task": context.get_task_id() is not None and context.get_actor_id() is None,
    }
