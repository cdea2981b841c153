"""Collectives across the ranks of a run, as Ray Train's ``ray.train.collective``:
:func:`barrier` and :func:`broadcast_from_rank_zero`.

They go through lockstep's driver channel, the one ``report()`` uses, not through
``torch.distributed``. So they work whatever the backend (no process group is needed: local mode
with ``num_workers=0`` has none, and neither has a custom :class:`~lockstep.BackendConfig`), they
never interleave with the user's own collectives on the process group (which must run in the
same order on every rank), and the driver sees who waits where: a rank that returns from the
train function while others wait in a barrier, or ranks that call ``barrier()`` and ``report()``
in different orders, fail the run with a message instead of hanging. The cost is a round trip
through the driver, which is fine for what these are for: small objects and occasional syncs
(for tensors, use ``torch.distributed``). Ray Train also routes them outside the process group
(through an actor).

Example:
    >>> from lockstep.collective import barrier, broadcast_from_rank_zero   # doctest: +SKIP
    >>> def train_func():
    ...     run_id = uuid.uuid4().hex if lockstep.get_context().get_world_rank() == 0 else None
    ...     run_id = broadcast_from_rank_zero(run_id)    # every rank gets rank 0's id
    ...     barrier()
"""

from __future__ import annotations

import logging
from typing import TypeVar

import cloudpickle

from lockstep._internal.rank.session_state import active_session

__all__ = ["barrier", "broadcast_from_rank_zero"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: Above this size a broadcast logs a warning (Ray Train warns above 1,000 bytes; here the
#: object only has to pass through the driver's socket, so larger ones work, just not fast).
BROADCAST_WARN_BYTES = 1_000_000


def barrier() -> None:
    """Wait until every rank has called ``barrier()``.

    Every rank must call it the same number of times, in the same order relative to
    ``report()`` and :func:`broadcast_from_rank_zero`.

    Raises:
        SessionNotActiveError: called outside a train function run by lockstep.
    """
    active_session("collective.barrier").collective("barrier")


def broadcast_from_rank_zero(data: T) -> T:
    """Return rank 0's ``data`` on every rank; also a barrier (every rank must call it).

    Rank 0's object is pickled (with cloudpickle), passed through the driver, which does not
    unpickle it, and unpickled on the other ranks; rank 0 gets its own object back unchanged.
    What the other ranks pass is ignored.

    Args:
        data: A picklable object, meant to be small (an id, a path, a config dict).

    Returns:
        Rank 0's ``data``.

    Raises:
        SessionNotActiveError: called outside a train function run by lockstep.
        TypeError: on rank 0, ``data`` can't be pickled.
    """
    session = active_session("collective.broadcast_from_rank_zero")
    if session.context.world_rank != 0:
        return cloudpickle.loads(session.collective("broadcast"))
    session.collective("broadcast", _pickled(data))
    return data


def _pickled(data: object) -> bytes:
    try:
        payload = cloudpickle.dumps(data)
    except Exception as error:
        raise TypeError(
            f"broadcast_from_rank_zero(): {type(data).__name__} can't be pickled ({error}); pass plain data "
            "(numbers, strings, lists, dicts) or another picklable object."
        ) from error
    if len(payload) > BROADCAST_WARN_BYTES:
        logger.warning(
            "broadcast_from_rank_zero(): %d bytes pickled; it is meant for small objects (for tensors "
            "use torch.distributed.broadcast).",
            len(payload),
        )
    return payload
