"""What the driver ships to every worker: the train function and everything it needs.

It is serialized once with cloudpickle (functions defined in ``__main__`` travel by value, so
the user's script is never re-imported in a worker) before any worker starts, so that an
object that can't be pickled is reported to the user at once.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle

from lockstep._internal.storage import RunStorage
from lockstep.backend import BackendConfig
from lockstep.checkpoint import Checkpoint
from lockstep.config import DataConfig

logger = logging.getLogger(__name__)

LARGE_PAYLOAD_BYTES = 100 * 1024 * 1024


@dataclass
class WorkerPayload:
    """Everything a worker needs to run its part of the job (the same for every rank)."""

    train_fn: Callable[..., Any]
    train_loop_config: dict[str, Any] | None
    backend_config: BackendConfig
    use_gpu: bool
    storage: RunStorage
    experiment_name: str
    first_report_index: int
    checkpoint: Checkpoint | None
    used_dir_names: list[str] = field(default_factory=list)
    datasets: dict[str, Any] = field(default_factory=dict)
    dataset_config: DataConfig = field(default_factory=DataConfig)
    metadata: dict[str, Any] = field(default_factory=dict)
    main_file: str | None = field(default_factory=lambda: _main_file())


def _main_file() -> str | None:
    """The path of the user's script, when the driver runs one."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path else None


def serialize_payload(payload: WorkerPayload) -> bytes:
    """Pickle the payload, naming the offending object if something in it can't be pickled.

    Raises:
        TypeError: an object reachable from the train function, its config or the datasets
            can't be pickled (the message names it).
    """
    try:
        data = cloudpickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        culprit = _find_unpicklable(payload)
        raise TypeError(
            f"{culprit} can't be sent to the workers: {type(error).__name__}: {error}. Create such "
            "objects (locks, open files, connections, CUDA state) inside the train function instead."
        ) from error
    if len(data) > LARGE_PAYLOAD_BYTES:
        logger.warning(
            "The train function and its config pickle to %.0f MB, copied to every worker. Load large "
            "datasets and models inside the train function instead of capturing or passing them.",
            len(data) / 1e6,
        )
    return data


def _find_unpicklable(payload: WorkerPayload) -> str:
    """A human name for the first part of the payload that fails to pickle."""
    candidates: list[tuple[str, Any]] = []
    candidates += [(f"train_loop_config[{key!r}]", value) for key, value in (payload.train_loop_config or {}).items()]
    candidates += [(f"datasets[{key!r}]", value) for key, value in payload.datasets.items()]
    candidates += _captured_by(payload.train_fn)
    candidates.append(("the train function", payload.train_fn))
    for name, value in candidates:
        try:
            cloudpickle.dumps(value)
        except Exception:
            return name
    return "part of the trainer's arguments"


def _captured_by(function: Any) -> list[tuple[str, Any]]:
    """The globals and closure variables a function refers to, with readable names."""
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    found: list[tuple[str, Any]] = []
    fn_globals = getattr(function, "__globals__", {})
    found += [(f"the global {name!r} used by the train function", fn_globals[name]) for name in code.co_names if name in fn_globals]
    for name, cell in zip(code.co_freevars, function.__closure__ or ()):
        try:
            found.append((f"the variable {name!r} captured by the train function", cell.cell_contents))
        except ValueError:
            continue
    return found
