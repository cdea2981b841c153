"""Text as a terminal shows it: a line holds what follows its last carriage return (a progress
bar redraws its line with ``\\r``), so a tail of a log shows lines, not every state of a bar."""

from __future__ import annotations

__all__ = ["shown_lines"]


def shown_lines(text: str) -> list[str]:
    """The lines of ``text`` as a terminal leaves them: each ``\\n``-line's last non-empty
    ``\\r``-part (a bar's last state; a line ending in ``\\r`` keeps the text before it)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [next((part for part in reversed(line.split("\r")) if part), "") for line in lines]
