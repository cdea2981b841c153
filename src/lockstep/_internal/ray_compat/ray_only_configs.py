"""Two configs Ray Train scripts pass that matter little here: :class:`LoggingConfig` (the level
of lockstep's own log messages) and :class:`SyncConfig` (refused: nothing is synced). Public
through :mod:`lockstep.config` and :mod:`lockstep`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any


@dataclass
class LoggingConfig:
    """The level of lockstep's own log messages (Ray Train's ``LoggingConfig``).

    Given to ``RunConfig(logging_config=...)``, it sets the level of the ``lockstep`` logger in
    this process when the RunConfig is made. Where the messages go is up to your logging set-up
    (e.g. ``logging.basicConfig()``); workers' log lines follow their own process's set-up.

    Args:
        log_level: A :mod:`logging` level name such as ``"DEBUG"`` or ``"INFO"`` (any case).
    """

    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not isinstance(self.log_level, str) or not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(
                f"LoggingConfig.log_level={self.log_level!r} is unknown; choose one of DEBUG, INFO, "
                "WARNING, ERROR, CRITICAL."
            )
        self.log_level = self.log_level.upper()

    def apply(self) -> None:
        """Set the level of the ``lockstep`` logger in this process."""
        logging.getLogger("lockstep").setLevel(self.log_level)


class SyncConfig:
    """Ray Train's syncing settings. lockstep has no sync step (ranks write checkpoints straight
    to ``RunConfig.storage_path``), so making one raises a ValueError that says so; the name is
    here so that scripts importing it load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "SyncConfig: lockstep has no sync step, ranks write checkpoints straight to RunConfig.storage_path "
            "(a local or shared folder, or a URI such as s3://bucket/prefix). Drop SyncConfig and sync_config=."
        )
