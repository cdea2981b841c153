"""Reported metrics as one line of text: for log lines, the progress line and `lockstep runs`."""

from __future__ import annotations

from typing import Any


def metrics_text(
    metrics: dict[str, Any], separator: str = ", ", limit: int | None = None, scalars_only: bool = False
) -> str:
    """``key=value`` pairs, floats to 4 significant digits; with ``scalars_only`` only numbers and
    strings (no bools, lists, dicts); cut to ``limit`` characters with "…"."""
    items = [
        f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in metrics.items()
        if not scalars_only or (isinstance(value, (int, float, str)) and not isinstance(value, bool))
    ]
    text = separator.join(items)
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"
