"""Metric names as Ray Tune writes them: a metric reported inside a nested dict is named by its
path, ``"outer/inner"`` (``RunConfig(stop=...)``, ``CheckpointConfig(checkpoint_score_attribute=...)``
and ``Result.get_best_checkpoint`` all take such names)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["flat_metrics", "metric_value"]


def flat_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``metrics`` with nested dicts flattened to ``"outer/inner"`` keys."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            flat.update(flat_metrics(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def metric_value(metrics: Mapping[str, Any], name: str) -> Any:
    """The metric ``name`` of ``metrics``: a top-level key, or the path of a nested one
    (``"val/acc"`` for ``{"val": {"acc": ...}}``); None when it was not reported."""
    if name in metrics:
        return metrics[name]
    return flat_metrics(metrics).get(name) if "/" in name else None
