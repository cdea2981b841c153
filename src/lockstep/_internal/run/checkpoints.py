"""Which committed checkpoints are the best and which to keep (CheckpointConfig's num_to_keep
and score).

The best checkpoints are the ``num_to_keep`` highest ranked, listed worst first (best last), as
Ray Train lists ``Result.best_checkpoints``; without a score attribute the rank is the report
order, so they are the latest ones, oldest first. The latest checkpoint is kept on storage even
when it is not among the best (a restart resumes from it), but it is not listed among them.

A checkpoint whose validation is still pending has no final score yet (its validation may
report the very metric it is ranked by): it is kept, and it is not among the best, until the
validation ends. So with ``num_to_keep=k`` the k best *validated* checkpoints stay, whatever the
order in which validations end (Ray Train 2.60 ranks it by its training metrics meanwhile and
can delete the best one before its score is known).
"""

from __future__ import annotations

import math
from typing import Any

from lockstep._internal.metric_names import metric_value
from lockstep._internal.persist.storage import CheckpointEntry
from lockstep.config import CheckpointConfig

#: The status of a checkpoint whose validation has not ended (``ReportedCheckpointStatus``'s value).
PENDING_VALIDATION = "PENDING_VALIDATION"


def awaiting_validation(entry: CheckpointEntry) -> bool:
    """Whether the checkpoint's validation has not ended yet."""
    return entry.validation == PENDING_VALIDATION


def ranked(entries: list[CheckpointEntry], config: CheckpointConfig) -> list[CheckpointEntry]:
    """Every entry, worst first by the score attribute (report order without one, or for ties:
    of two with the same score, the later one ranks higher). ``entries`` are in commit order."""
    return sorted(entries, key=lambda entry: _score(entry, config))  # stable: ties stay in report order


def best_checkpoints(entries: list[CheckpointEntry], config: CheckpointConfig) -> list[CheckpointEntry]:
    """The ``num_to_keep`` best of the entries whose score is known (all when None), worst first."""
    scored = ranked([entry for entry in entries if not awaiting_validation(entry)], config)
    return scored if config.num_to_keep is None else scored[-config.num_to_keep :]


def checkpoints_to_delete(entries: list[CheckpointEntry], config: CheckpointConfig) -> list[CheckpointEntry]:
    """The entries that are neither among the best, nor the latest (the last entry), nor awaiting
    their validation; oldest first."""
    if not entries or config.num_to_keep is None:
        return []
    kept = [*best_checkpoints(entries, config), entries[-1]]
    return [entry for entry in entries if entry not in kept and not awaiting_validation(entry)]


def unscored(entry: CheckpointEntry, config: CheckpointConfig) -> bool:
    """Whether ``config`` ranks by a score attribute that ``entry``'s metrics lack (or that is
    not a number): such a checkpoint ranks last, and retention deletes it first."""
    return config.checkpoint_score_attribute is not None and _score(entry, config) == -math.inf


def _score(entry: CheckpointEntry, config: CheckpointConfig) -> float:
    """Higher is better; a checkpoint without the metric ranks last; without a score attribute
    every checkpoint scores the same (so report order decides). A nested metric is named by its
    path, ``"val/acc"``, as Ray Train names it."""
    if config.checkpoint_score_attribute is None:
        return 0.0
    value: Any = metric_value(entry.metrics, config.checkpoint_score_attribute)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        return -math.inf
    return float(value) if config.checkpoint_score_order == "max" else -float(value)
