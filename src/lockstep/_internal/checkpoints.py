"""Which committed checkpoints to keep (CheckpointConfig's num_to_keep and score)."""

from __future__ import annotations

import math
from typing import Any

from lockstep._internal.storage import CheckpointEntry
from lockstep.config import CheckpointConfig


def checkpoints_to_delete(entries: list[CheckpointEntry], config: CheckpointConfig) -> list[CheckpointEntry]:
    """The entries that fall outside ``num_to_keep``, oldest first. The latest checkpoint (the
    last entry) is never among them, even when its score is not among the best."""
    keep_count = config.num_to_keep
    if keep_count is None or len(entries) <= keep_count:
        return []
    latest = entries[-1]
    if config.checkpoint_score_attribute is None:
        kept = entries[-keep_count:]
    else:
        ranked = sorted(entries, key=lambda entry: _score(entry, config), reverse=True)
        kept = ranked[:keep_count]
    return [entry for entry in entries if entry not in kept and entry is not latest]


def _score(entry: CheckpointEntry, config: CheckpointConfig) -> float:
    """Higher is better; a checkpoint without the metric ranks last."""
    value: Any = entry.metrics.get(config.checkpoint_score_attribute or "")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        return -math.inf
    return float(value) if config.checkpoint_score_order == "max" else -float(value)
