"""How a failure message of many ranks is folded: ranks that failed the same way share one
paragraph, and long lists of ranks are written as spans (``ranks 3-63``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from lockstep._internal.rank_spans import rank_span


class RankFailure(Protocol):
    """What a folded message reads of one rank's failure (``lockstep.errors.WorkerFailure``)."""

    @property
    def rank(self) -> int: ...
    @property
    def error_type(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def traceback(self) -> str: ...
    def describe(self) -> str: ...


#: More failed ranks than this are named as spans (``ranks 3-63``) in an error's first line.
FOLDED_FROM = 8


def ranks_phrase(ranks: list[int]) -> str:
    """How a message names ``ranks``: "rank 3 was" or "ranks 0-2 were"."""
    return f"rank {ranks[0]} was" if len(ranks) == 1 else f"ranks {rank_span(ranks)} were"


def by_text(texts: Mapping[int, str]) -> list[tuple[str, list[int]]]:
    """The distinct texts of ``texts`` (rank -> text), each with the ranks that have it, in rank order."""
    groups: dict[str, list[int]] = {}
    for rank, text in sorted(texts.items()):
        groups.setdefault(text, []).append(rank)
    return list(groups.items())


def folded_failures(failures: Sequence[RankFailure]) -> list[str]:
    """Each failure's paragraph; ranks that failed the same way (the same error, message and
    traceback, once their own rank number is taken out) share one, so a run of 64 ranks that
    all lost the same peer reads as one paragraph, not 64."""
    generic = {failure.rank: _without_rank(failure) for failure in failures}
    paragraphs = []
    for _, group in by_text(generic):
        first = next(failure for failure in failures if failure.rank == group[0])
        if len(group) == 1:
            paragraphs.append(first.describe())
        else:
            paragraphs.append(f"ranks {rank_span(group)} (the same for each; rank {group[0]}'s): {first.describe()}")
    return paragraphs


def _without_rank(failure: RankFailure) -> str:
    own = f"rank {failure.rank}"
    text = f"{failure.error_type}: {failure.message}\n{failure.traceback}"
    return text.replace(own + " ", "rank # ").replace(own + ":", "rank #:").replace(own + ",", "rank #,")
