"""A rank's part in riding out storage outages (see :mod:`lockstep._internal.persist.retry`):
while it retries, it is making progress for the hang detector; the checkpoint it resumes from is
read with the run's retry bound; and each outage it rode out is told to the driver, which keeps
the time lost in the run record."""

from __future__ import annotations

import logging

from lockstep._internal.persist.filesystems import use_retry_by_default
from lockstep._internal.persist.retry import Outage, mark_waits_with
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.rank.progress import PROGRESS
from lockstep._internal.wire import protocol
from lockstep._internal.wire.channel import WorkerChannel

__all__ = ["ride_out_outages"]

logger = logging.getLogger(__name__)


def ride_out_outages(storage: RunStorage, channel: WorkerChannel, rank: int) -> None:
    """Set up this rank's storage retries (see the module's docstring). Where the rank runs in
    the driver's own process (local mode, torchrun's rank 0) and shares its storage, the driver
    already records the outages."""
    mark_waits_with(PROGRESS.making_progress)
    use_retry_by_default(storage.retry)
    if storage.retry.on_outage_end is None:
        storage.retry.on_outage_end = lambda outage: _tell_driver(channel, rank, outage)


def _tell_driver(channel: WorkerChannel, rank: int, outage: Outage) -> None:
    try:
        channel.send(protocol.StorageOutage(rank, outage.started_at, outage.lasted_s, outage.retries))
    except OSError as error:  # the run is ending: the outage is in this rank's log all the same
        logger.debug("could not tell the driver of a storage outage: %s", error)
