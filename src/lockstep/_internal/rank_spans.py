"""Sets of ranks written short: ``0-3, 5, 7-63``, for messages and tables that stay readable
at hundreds of ranks."""

from __future__ import annotations

from collections.abc import Iterable


def rank_span(ranks: Iterable[int], separator: str = ", ") -> str:
    """``ranks`` in short, consecutive ranks as one span: ``0-3, 5, 7-63``."""
    spans: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return separator.join(f"{first}-{last}" if last > first else f"{first}" for first, last in spans)
