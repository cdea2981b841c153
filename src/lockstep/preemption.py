"""What a rank knows of a coming preemption: :class:`PreemptionInfo`, as
``lockstep.get_preemption_info()`` returns it (Ray Train 2.60's name and shape).

A preemption notice is a SIGTERM: to the driver (the machine is going away: every rank is
affected), or to one rank's process (a pod eviction: that rank is). lockstep keeps training
until the next checkpoint is committed, within ``FailureConfig(preemption_grace_s=...)``, then
stops the run as ``preempted``; running the same command again continues from that checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PreemptionInfo"]


@dataclass(frozen=True)
class PreemptionInfo:
    """A preemption notice, as every rank learns it at its next ``report()``.

    Attributes:
        deadline_ms: When lockstep stops the run at the latest (UNIX time in milliseconds): the
            notice's time plus ``FailureConfig.preemption_grace_s``.
        preempted_node_to_ranks: Each host that got a notice (its hostname; Ray Train uses the
            node id) and the world ranks that run there and are affected.

    Example:
        >>> info = PreemptionInfo(1_700_000_000_000, {"node-a": [1, 0]})
        >>> info.preempted_ranks
        [0, 1]
    """

    deadline_ms: int | None
    preempted_node_to_ranks: dict[str, list[int]] = field(default_factory=dict)

    @property
    def preempted_node_ids(self) -> list[str]:
        """The hosts that got a notice, sorted."""
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self) -> list[int]:
        """Every affected world rank, sorted."""
        return sorted({rank for ranks in self.preempted_node_to_ranks.values() for rank in ranks})
