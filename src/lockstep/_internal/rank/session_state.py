"""This process's worker session: the one train function lockstep runs here, if any. The worker
runtime installs it (:func:`set_session`); ``lockstep.report()`` and the other train-function
calls find it (:func:`active_session`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep.errors import SessionNotActiveError

if TYPE_CHECKING:
    from lockstep._internal.rank.worker_session import WorkerSession

__all__ = ["active_session", "current_session", "set_session"]

_session: WorkerSession | None = None


def set_session(session: WorkerSession | None) -> None:
    """Install (or clear) this process's worker session. Called by the worker runtime."""
    global _session
    _session = session


def current_session() -> WorkerSession | None:
    """The session of the train function running in this process, or None outside one."""
    return _session


def active_session(caller: str) -> WorkerSession:
    """The session of the train function running in this process.

    Raises:
        SessionNotActiveError: called outside a train function run by lockstep.
    """
    if _session is None:
        raise SessionNotActiveError(
            f"lockstep.{caller}() works only inside the train function that TorchTrainer.fit() runs; "
            "call it from train_loop_per_worker."
        )
    return _session
