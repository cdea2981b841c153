"""Errors raised by lockstep. All of them survive pickling, so they cross process boundaries.

``fit()`` raises a :class:`TrainingFailedError`, as Ray Train's ``fit()`` does, and more
precisely one of its two kinds:

- :class:`WorkerGroupError`: workers failed (raised, died, or broke the ``report()``
  collective); ``.worker_failures`` maps each failed rank to a :class:`WorkerError`.
- :class:`ControllerError`: the driver itself could not go on (the workers could not be placed,
  the run record could not be written, ...).
- :class:`PreemptionError`: the run stopped after a preemption notice (SIGTERM); run the same
  command again to continue from its latest checkpoint.

Storage that fails raises :class:`StorageFullError` (no space left) or
:class:`StorageUnreachableError` (transient errors past ``RunConfig.storage_retry_s``) where it
fails: in ``report()`` on a rank (and ``fit()`` raises a ``TrainingFailedError`` naming it), or
in the driver, or when a ``Checkpoint`` or ``Result`` is read outside a run.

Example:
    >>> import lockstep
    >>> try:
    ...     trainer.fit()                                   # doctest: +SKIP
    ... except lockstep.WorkerGroupError as error:
    ...     for rank, failure in error.worker_failures.items():
    ...         print(rank, failure.error_type, failure.message)
"""

from __future__ import annotations

import builtins
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockstep._internal.failure_text import FOLDED_FROM, by_text, folded_failures, ranks_phrase
from lockstep._internal.rank_spans import rank_span

if TYPE_CHECKING:
    from lockstep.preemption import PreemptionInfo

__all__ = [
    "CheckpointCorruptedError",
    "ControllerError",
    "HangUp",
    "NCCLHangError",
    "PreemptionError",
    "SessionNotActiveError",
    "StorageFullError",
    "StorageUnreachableError",
    "TrainingFailedError",
    "WorkerError",
    "WorkerFailure",
    "WorkerGroupError",
]


@dataclass(frozen=True)
class WorkerFailure:
    """What went wrong on one rank.

    Attributes:
        rank: The world rank that failed.
        error_type: The exception's class name, e.g. ``"ValueError"``, or one of the kinds
            lockstep itself detects (``lockstep._internal.run.failures.FailureKind``):
            ``"WorkerDied"`` (the process ended without a Python error: killed, ``os._exit``,
            a lost node), ``"ReportMismatch"`` (the rank returned from the train function while
            others waited in ``report()``), ``"ReportTimeout"`` (the rank did not reach a
            ``report()`` the others waited in within ``FailureConfig.report_timeout_s``),
            ``"CheckpointUploadError"`` (the rank's ASYNC checkpoint upload failed),
            ``"ChannelViolation"`` (the rank's channel carried a message claiming another rank),
            ``"Hang"`` (the rank stopped making progress while others waited, past the hang
            threshold of ``FailureConfig``).
        message: The exception's message, or how the process ended.
        traceback: The worker's formatted traceback (empty when the process died without one).
    """

    rank: int
    error_type: str
    message: str
    traceback: str = ""

    def describe(self) -> str:
        """One paragraph for humans: the rank, the error and its traceback."""
        head = f"rank {self.rank}: {self.error_type}: {self.message}"
        return f"{head}\n{self.traceback.rstrip()}" if self.traceback else head


class WorkerError(Exception):
    """The exception a rank raised, as the driver knows it: its type name, message and traceback.

    The driver never rebuilds the user's exception class (workers speak JSON to it, and
    unpickling a class from a worker would run its code), so this stands in for it. When the
    rank raised a built-in exception (``ValueError``, ``KeyError``, ``RuntimeError``, ...), the
    object is also an instance of that built-in class, so ``isinstance(error, ValueError)`` holds.

    Attributes:
        rank: The world rank that failed.
        error_type: The original exception's class name (or lockstep's kind, see
            :attr:`WorkerFailure.error_type`).
        message: The original exception's message.
        traceback: The rank's formatted traceback ("" when the process died without one).
        failure: The :class:`WorkerFailure` this was built from.
    """

    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.rank = failure.rank
        self.error_type = failure.error_type
        self.message = failure.message
        self.traceback = failure.traceback

    @classmethod
    def from_failure(cls, failure: WorkerFailure) -> WorkerError:
        """The stand-in for ``failure``'s exception (an instance of the built-in class it names,
        when it names one)."""
        try:
            return _worker_error_class(failure.error_type)(failure)
        except TypeError:  # a built-in whose constructor wants other arguments (UnicodeError & co)
            return WorkerError(failure)

    def __str__(self) -> str:
        return f"{self.error_type}: {self.message}"

    def __repr__(self) -> str:
        return f"WorkerError(rank={self.rank}, error_type={self.error_type!r}, message={self.message!r})"

    def __reduce__(self) -> tuple[Any, tuple[WorkerFailure]]:
        return (WorkerError.from_failure, (self.failure,))


_WORKER_ERROR_CLASSES: dict[str, type[WorkerError]] = {}


def _worker_error_class(error_type: str) -> type[WorkerError]:
    """:class:`WorkerError`, mixed with the built-in exception class ``error_type`` names."""
    builtin = getattr(builtins, error_type, None)
    if not (isinstance(builtin, type) and issubclass(builtin, Exception)) or builtin is Exception:
        return WorkerError
    if error_type not in _WORKER_ERROR_CLASSES:
        try:
            _WORKER_ERROR_CLASSES[error_type] = type(f"WorkerError[{error_type}]", (WorkerError, builtin), {})
        except TypeError:  # a built-in whose instance layout can't be mixed in (OSError & co)
            _WORKER_ERROR_CLASSES[error_type] = WorkerError
    return _WORKER_ERROR_CLASSES[error_type]


class TrainingFailedError(RuntimeError):
    """Training did not finish: a worker raised, died, or the run could not go on.

    ``fit()`` raises one of its subclasses, :class:`WorkerGroupError` or :class:`ControllerError`.

    Attributes:
        failures: The failures that ended the run, by rank.
    """

    def __init__(self, message: str, failures: Mapping[int, WorkerFailure] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, WorkerFailure] = dict(failures or {})

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), (self.args[0], self.failures))

    @classmethod
    def from_failures(
        cls, failures: list[WorkerFailure], context: str = "", stacks: dict[int, str] | None = None
    ) -> TrainingFailedError:
        """Build the error shown to the user from the failures of one attempt, with the Python
        stacks of the ranks that were still running (where they were stuck)."""
        named = [failure.rank for failure in failures]
        which = f"ranks {rank_span(named)}" if len(named) > FOLDED_FROM else f"rank {', '.join(map(str, named))}"
        lines = [f"Training failed on {which}{context}."]
        lines += folded_failures(failures)
        lines += [
            f"{ranks_phrase(group)} still running, here:\n{stack.rstrip()}"
            for stack, group in by_text({rank: stack.rstrip() for rank, stack in (stacks or {}).items()})
        ]
        return cls("\n\n".join(lines), {failure.rank: failure for failure in failures})


class WorkerGroupError(TrainingFailedError):
    """Training failed because workers failed: a rank raised, its process died, or it broke the
    ``report()`` collective (returned early, or never came).

    As Ray Train's ``WorkerGroupError``, with the difference that each value of
    ``worker_failures`` is a :class:`WorkerError` (type name, message, traceback) rather than the
    rank's own exception object.

    Args:
        message: What happened, for humans.
        worker_failures: The failure of each rank, as :class:`WorkerFailure` records, or as
            exceptions (turned into records: their class name, message and traceback).

    Attributes:
        worker_failures: Each failed rank's error, by rank.
        failures: The same as :class:`WorkerFailure` records.
    """

    def __init__(
        self, message: str, worker_failures: Mapping[int, WorkerFailure | BaseException] | None = None
    ) -> None:
        super().__init__(message, {rank: _as_failure(rank, item) for rank, item in (worker_failures or {}).items()})
        self.worker_failures: dict[int, WorkerError] = {
            rank: WorkerError.from_failure(failure) for rank, failure in self.failures.items()
        }


def _as_failure(rank: int, item: WorkerFailure | BaseException) -> WorkerFailure:
    if isinstance(item, WorkerFailure):
        return item
    if isinstance(item, WorkerError):
        return item.failure
    import traceback

    text = "".join(traceback.format_exception(item)) if item.__traceback__ is not None else ""
    return WorkerFailure(rank, type(item).__name__, str(item), text)


class HangUp(BaseException):
    """The run ended because a process got SIGHUP (its terminal closed, or torchrun passed its
    own on): the run is recorded as ``interrupted``. A BaseException, as KeyboardInterrupt, so
    that ``except Exception`` in a train function does not swallow it."""


class NCCLHangError(WorkerGroupError):
    """A hang around an NCCL collective, as Ray Train names it: the hang detector found that no
    rank made progress for ``FailureConfig``'s hang threshold, and a rank waits in an NCCL
    collective (torch's flight recorder names it). Its ``failures`` are the stuck ranks (error
    type ``"Hang"``). A hang on gloo is a plain :class:`WorkerGroupError` with the same failures.
    (A GPU-only path, not yet run on GPUs.)"""


class ControllerError(TrainingFailedError):
    """Training failed because the driver could not go on (not because of a worker): the
    workers could not be placed, the run record could not be written, an internal error.

    Args:
        message: What happened, for humans; or, as in Ray Train, the exception itself.
        failures: Worker failures seen before the driver gave up, if any.
        controller_failure: The exception that stopped the driver, when there was one.

    Attributes:
        controller_failure: That exception (after pickling, a ``RuntimeError`` with its type and
            message when the original could not be pickled); ``None`` when there was none.
    """

    def __init__(
        self,
        message: str | BaseException,
        failures: Mapping[int, WorkerFailure] | None = None,
        controller_failure: BaseException | None = None,
    ) -> None:
        if isinstance(message, BaseException):
            controller_failure = controller_failure or message
            message = f"The driver could not go on: {type(message).__name__}: {message}"
        super().__init__(message, failures)
        self.controller_failure = controller_failure

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), (self.args[0], self.failures, _picklable(self.controller_failure)))


class PreemptionError(TrainingFailedError):
    """The run stopped because its machine (or a rank's) is being taken away: a SIGTERM came,
    lockstep trained on to the next committed checkpoint (or until
    ``FailureConfig.preemption_grace_s`` ran out, or a second SIGTERM) and stopped. The run
    record says ``preempted``; running the same command again continues from the latest
    checkpoint, and the preemption is not counted as a failure.

    Args:
        message: What happened, for humans.
        preemption_info: The notice: which ranks, on which hosts, and the deadline.
        drain_timed_out: True when the run stopped before a checkpoint was committed after the
            notice (the grace ran out, a second SIGTERM came, or a preempted rank died).

    Attributes:
        preemption_info: As passed (``None`` where only the message crossed, e.g. on a
            torchrun rank other than 0 that heard of the preemption from rank 0 alone).
        drain_timed_out: As passed.
    """

    def __init__(
        self, message: str, preemption_info: PreemptionInfo | None = None, drain_timed_out: bool = False
    ) -> None:
        super().__init__(message)
        self.preemption_info = preemption_info
        self.drain_timed_out = drain_timed_out

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), (self.args[0], self.preemption_info, self.drain_timed_out))


class CheckpointCorruptedError(OSError):
    """A checkpoint's files are not the files that were committed: one is missing, or its size
    or checksum differs from the manifest written at the commit.

    Attributes:
        checkpoint: The checkpoint's path or URI.
        problems: One line per damaged file.
    """

    def __init__(self, checkpoint: str, problems: list[str]) -> None:
        self.checkpoint = checkpoint
        self.problems = list(problems)
        listed = "; ".join(self.problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        super().__init__(
            f"checkpoint {checkpoint} is damaged: {listed}. Its files are not those written when it was "
            "committed (their sizes and checksums are in its manifest, in the run folder's .lockstep_manifests/). "
            "Load an older checkpoint of the run (`lockstep verify RUN` says which are whole), or restore the "
            "folder from a copy."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.checkpoint, self.problems))


def _picklable(error: BaseException | None) -> BaseException | None:
    """``error`` if it survives pickling, else a RuntimeError that says what it was."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle means: send a plain stand-in
        return RuntimeError(f"{type(error).__name__}: {error}")


def error_class_named(name: str) -> type[TrainingFailedError]:
    """The :class:`TrainingFailedError` class called ``name`` (as a run record or another rank
    names it), or :class:`TrainingFailedError` itself for any other name."""
    classes = {cls.__name__: cls for cls in (WorkerGroupError, NCCLHangError, ControllerError, PreemptionError)}
    return classes.get(name, TrainingFailedError)


class SessionNotActiveError(RuntimeError):
    """A worker-only function (``report``, ``get_context``, …) was called outside a train function."""


class StorageFullError(OSError):
    """The storage has no room for what lockstep was writing (a checkpoint, the run record):
    the disk or the quota is full. The message says where, and how much was needed; the run
    record still names the last whole checkpoint, and running again with the same
    ``RunConfig.name`` once space is freed continues from it. Never retried."""


class StorageUnreachableError(OSError):
    """Storage kept failing with transient errors (connections refused or reset, timeouts,
    throttling, 5xx) for longer than ``RunConfig.storage_retry_s``. The message says for how
    long, where, and how to wait longer."""
