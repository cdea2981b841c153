"""Default run names."""

from __future__ import annotations

import time
import uuid


def default_run_name(trainer_name: str) -> str:
    """``<Trainer>_<date>_<time>_<4 hex>``: sortable, and unique even for runs started in the same second."""
    return f"{trainer_name}_{time.strftime('%Y-%m-%d_%H-%M-%S')}_{uuid.uuid4().hex[:4]}"
