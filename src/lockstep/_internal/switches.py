"""lockstep's on/off settings read from the environment (``LOCKSTEP_WARM_START``,
``LOCKSTEP_FAST_EXIT``): on unless set to 0, false, off or no."""

from __future__ import annotations

import os

__all__ = ["switched_on"]

_OFF = frozenset({"0", "false", "off", "no"})


def switched_on(variable: str) -> bool:
    """Whether the setting in the environment variable ``variable`` is on (unset: on)."""
    return os.environ.get(variable, "1").strip().lower() not in _OFF
