"""Where a validation function runs: :func:`run_validation_fn` (a Ray task calls it too) and the
validation process, ``python -m lockstep._internal.rank.validation_process``, that the driver
starts afresh on its machine for each validation (see
:mod:`lockstep._internal.executors.local_validation`).

The process reads its job (the pickled function, checkpoint and keyword arguments) from a
descriptor the driver filled, and writes one JSON answer to the pipe it got from the driver:
``{"metrics": {...}}``, or ``{"error": "<traceback>", "retry": bool}``. It never sends a pickle.
When the driver dies, the pipe's reading end closes; the process sees it and ends with
everything it started.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import traceback
from typing import Any

ENV_JOB_FD = "LOCKSTEP_VALIDATION_JOB_FD"
ENV_ANSWER_FD = "LOCKSTEP_VALIDATION_ANSWER_FD"


def run_validation_fn(fn: Any, checkpoint: Any, fn_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``fn(checkpoint, **fn_kwargs)``, checked: a dict of metrics that can be saved (tensors
    and numpy scalars become numbers), as plain JSON values.

    Raises:
        ValueError: the function returned something other than a dict.
        TypeError: a metric can't be saved.
    """
    from lockstep._internal.rank.metrics_json import encode_metrics

    metrics = fn(checkpoint, **fn_kwargs)
    if not isinstance(metrics, dict):
        raise ValueError(
            f"The validation function must return a dict of metrics, got {type(metrics).__name__}: {metrics!r:.200}."
        )
    result: dict[str, Any] = json.loads(encode_metrics(metrics))
    return result


def answer(fn: Any, checkpoint: Any, fn_kwargs: dict[str, Any], retry_exceptions: Any) -> dict[str, Any]:
    """What the process tells the driver: the metrics, or the error and whether
    ``retry_exceptions`` (Ray's option: True, or a list of exception classes) asks to try again."""
    try:
        return {"metrics": run_validation_fn(fn, checkpoint, fn_kwargs)}
    except Exception as error:  # noqa: BLE001 - every failure is the validation's outcome
        if isinstance(retry_exceptions, (list, tuple)):
            retry = isinstance(error, tuple(retry_exceptions))
        else:
            retry = bool(retry_exceptions)
        return {"error": _user_traceback(error), "retry": retry}


def _user_traceback(error: BaseException) -> str:
    """The error's traceback without this module's frames (the user's function is what failed)."""
    frames = error.__traceback__
    while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next
    return "".join(traceback.format_exception(type(error), error, frames or error.__traceback__))


def end_with_the_driver(answer_fd: int) -> None:
    """Kill this process's session (itself and what it started) once the driver's end of the
    answer pipe closes: the driver died, or stopped this validation."""

    def watch() -> None:
        poller = select.poll()
        poller.register(answer_fd, 0)  # no events asked for: only errors and hang-ups are reported
        while True:
            for _, event in poller.poll():
                if event & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="lockstep-driver-watch", daemon=True).start()


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)  # the driver wrote it: its offset is at the end
    with open(fd, "rb", closefd=True) as handle:
        return handle.read()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main() -> None:
    """Run the validation the driver handed over, write its answer, exit."""
    import cloudpickle

    from lockstep._internal.rank.worker import restore_source_file

    answer_fd = int(os.environ[ENV_ANSWER_FD])
    end_with_the_driver(answer_fd)
    try:
        fn_bytes, checkpoint, fn_kwargs, retry_exceptions, main_file = cloudpickle.loads(
            _read_all(int(os.environ[ENV_JOB_FD]))
        )
        fn = cloudpickle.loads(fn_bytes)
        restore_source_file(fn, main_file)
    except Exception:  # noqa: BLE001 - e.g. a module the function needs is not importable here
        reply: dict[str, Any] = {"error": traceback.format_exc(), "retry": False}
    else:
        reply = answer(fn, checkpoint, fn_kwargs, retry_exceptions)
    data = json.dumps(reply).encode()
    sys.stdout.flush()
    sys.stderr.flush()
    _write_all(answer_fd, data)
    os._exit(0)  # no lingering threads (data loaders, the watch)


if __name__ == "__main__":
    main()
