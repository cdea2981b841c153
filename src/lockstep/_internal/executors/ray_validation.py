"""Validations on a Ray cluster: each one a Ray task with ``ValidationConfig.ray_remote_kwargs``
as its ``ray.remote()`` options (as Ray Train 2.60 runs them). The function travels pickled
by cloudpickle and is loaded in the task once the driver's own import path entries are added
(as lockstep's actors do), so functions of the user's modules load there too. The task returns
the metrics as a JSON string; an error it raises (after Ray's own retries) is the validation's
failure."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import cloudpickle

from lockstep._internal.rank.python_path import user_python_path
from lockstep._internal.run.validation import RunningValidation, ValidationLauncher, ValidationOutcome, ValidationTask
from lockstep.validation import ValidationConfig


def validate_in_task(fn_bytes: bytes, checkpoint: Any, fn_kwargs: dict[str, Any], python_path: list[str]) -> str:
    """The Ray task: the validation function's metrics, as JSON."""
    from lockstep._internal.rank.validation_process import run_validation_fn

    saved = list(sys.path)
    sys.path[:0] = [entry for entry in python_path if os.path.isdir(entry) and entry not in sys.path]
    try:
        return json.dumps(run_validation_fn(cloudpickle.loads(fn_bytes), checkpoint, fn_kwargs))
    finally:
        sys.path[:] = saved


class RayValidationLauncher(ValidationLauncher):
    """Starts each validation as a Ray task.

    Raises:
        ValueError, TypeError: Ray refuses ``ray_remote_kwargs`` (said before any rank starts).
    """

    def __init__(self, config: ValidationConfig) -> None:
        import ray

        try:
            self._task = ray.remote(validate_in_task).options(**config.ray_remote_kwargs)
        except (TypeError, ValueError) as error:
            raise ValueError(f"ValidationConfig(ray_remote_kwargs=...): Ray refuses them: {error}") from error
        try:
            self._fn = ray.put(cloudpickle.dumps(config.fn))
        except Exception as error:
            raise TypeError(
                f"ValidationConfig(fn=...) can't be sent to a Ray task: {type(error).__name__}: {error}. Create "
                "such objects (locks, open files, connections) inside the validation function instead."
            ) from error

    def start(self, task: ValidationTask) -> RunningValidation:
        """Submit the task; return at once."""
        return RayValidation(self._task.remote(self._fn, task.checkpoint, task.fn_kwargs, user_python_path()))


class RayValidation(RunningValidation):
    """One validation's Ray task."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self._outcome: ValidationOutcome | None = None

    def wait(self, timeout: float | None) -> ValidationOutcome | None:
        """The task's outcome once it ended; None while it runs after ``timeout`` seconds."""
        import ray

        if self._outcome is None:
            ready, _ = ray.wait([self.ref], timeout=timeout)
            if ready:
                self._outcome = _outcome_of(self.ref)
        return self._outcome

    def cancel(self) -> None:
        """Cancel the task (its worker process is killed)."""
        import ray

        if self._outcome is None:
            ray.cancel(self.ref, force=True)
            self._outcome = ValidationOutcome(error="stopped by the driver")


def _outcome_of(ref: Any) -> ValidationOutcome:
    import ray

    try:
        metrics = json.loads(ray.get(ref))
    except ray.exceptions.RayError as error:
        return ValidationOutcome(error=str(error))
    return ValidationOutcome(metrics=metrics)
