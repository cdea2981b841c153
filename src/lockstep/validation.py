"""Checkpoint validation, as in Ray Train 2.60: a function that scores a committed checkpoint in
a process of its own while training goes on.

Give the trainer a :class:`ValidationConfig` and pass ``validation=True`` (or a
:class:`ValidationTaskConfig`) to ``report()`` with a checkpoint. ``report()`` returns as it
always does; once the checkpoint is committed, the driver starts the validation function on it
(one at a time by default, in a fresh process on one machine, as a Ray task on a Ray cluster).
The dict it returns joins that checkpoint's metrics in the run record, so it counts for
``CheckpointConfig``'s ranking, ``Result.best_checkpoints`` and
``get_all_reported_checkpoints()``. A validation that raises or runs out of time marks its
checkpoint ``VALIDATION_FAILED`` / ``VALIDATION_TIMEOUT``; the run goes on. ``fit()`` waits for
the validations still running; those an interrupted run left are run by the next ``fit()`` of
the same run.

Example:
    >>> def validate(checkpoint, dataset="val"):                      # doctest: +SKIP
    ...     model = load_model(checkpoint)
    ...     return {"val_loss": evaluate(model, dataset)}
    >>> trainer = TorchTrainer(train_func, validation_config=ValidationConfig(validate))  # doctest: +SKIP
    >>> # in train_func:
    >>> lockstep.report(metrics, checkpoint=checkpoint, validation=True)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lockstep.checkpoint import Checkpoint

__all__ = ["ValidationConfig", "ValidationFn", "ValidationTaskConfig"]


class ValidationFn(Protocol):
    """A function that validates a checkpoint: ``fn(checkpoint, **fn_kwargs) -> dict`` of metrics."""

    def __call__(self, checkpoint: Checkpoint, **kwargs: Any) -> dict[str, Any]: ...


@dataclass
class ValidationTaskConfig:
    """How to validate one checkpoint; pass it as ``report(..., validation=ValidationTaskConfig(...))``,
    or as ``ValidationConfig(task_config=...)`` for the defaults.

    Args:
        fn_kwargs: Keyword arguments for the validation function (the checkpoint always comes
            first). Given to ``report()``, they are merged over the defaults of
            ``ValidationConfig.task_config`` (these win) and must be JSON-serializable (they
            are kept in the run record until the validation ends).
        timeout_s: Seconds the validation may run before it is stopped and its checkpoint
            marked ``VALIDATION_TIMEOUT``; None: no limit. Given to ``report()``, it replaces
            the default's, also when None.

    Raises:
        ValueError: ``timeout_s`` is not None or a number > 0, or ``fn_kwargs`` is not a dict.
    """

    fn_kwargs: dict[str, Any] | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.fn_kwargs is None:
            self.fn_kwargs = {}
        if not isinstance(self.fn_kwargs, Mapping) or not all(isinstance(key, str) for key in self.fn_kwargs):
            raise ValueError(
                "ValidationTaskConfig.fn_kwargs must be a dict of keyword arguments (str keys), "
                f"got {self.fn_kwargs!r}."
            )
        self.fn_kwargs = dict(self.fn_kwargs)
        timeout = self.timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ValueError(
                f"ValidationTaskConfig.timeout_s must be None (no limit) or a number of seconds > 0, got {timeout!r}."
            )


class ValidationConfig:
    """The trainer's validation function and its defaults (``TorchTrainer(validation_config=...)``).

    Args:
        fn: The :class:`ValidationFn`: takes the checkpoint first, then keyword arguments, and
            returns a dict of metrics. It travels by value (cloudpickle), like the train function.
        task_config: Default ``fn_kwargs`` and ``timeout_s``, used for ``report(validation=True)``
            and merged under those of a ``ValidationTaskConfig`` passed to ``report()``.
        ray_remote_kwargs: Ray's ``ray.remote()`` options for the validation task, e.g.
            ``{"num_cpus": 2, "num_gpus": 1}``. On Ray they are passed as they are; on one
            machine lockstep uses ``num_cpus`` (default 1: the process's threads, counted with the
            workers' CPUs), ``num_gpus`` (default 0: ``CUDA_VISIBLE_DEVICES`` of the process),
            ``memory``, ``max_retries`` (default 3: runs again a process that died without an
            answer), ``retry_exceptions`` and ``name``; other keys need a Ray cluster and raise.

    Raises:
        ValueError: ``fn`` is not callable, or ``task_config`` / ``ray_remote_kwargs`` have the
            wrong type.
    """

    def __init__(
        self,
        fn: ValidationFn,
        task_config: ValidationTaskConfig | None = None,
        ray_remote_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"ValidationConfig(fn=...) must be a function, got {type(fn).__name__}.")
        if task_config is not None and not isinstance(task_config, ValidationTaskConfig):
            raise ValueError(
                f"ValidationConfig(task_config=...) must be a ValidationTaskConfig, got {type(task_config).__name__}."
            )
        if ray_remote_kwargs is not None and not isinstance(ray_remote_kwargs, Mapping):
            raise ValueError(
                "ValidationConfig(ray_remote_kwargs=...) must be a dict of ray.remote() options, "
                f"got {type(ray_remote_kwargs).__name__}."
            )
        self.fn = fn
        self.task_config = task_config if task_config is not None else ValidationTaskConfig()
        self.ray_remote_kwargs: dict[str, Any] = dict(ray_remote_kwargs or {})

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        options = self.ray_remote_kwargs
        return f"ValidationConfig(fn={name}, task_config={self.task_config!r}, ray_remote_kwargs={options!r})"
