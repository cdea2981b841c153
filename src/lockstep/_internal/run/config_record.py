"""A run's configuration as its record keeps it (``config``), for the dashboard and other readers:
the train loop's config and the trainer's configs, made JSON-safe (a value JSON can't hold is
kept as its ``repr``, cut to :data:`MAX_TEXT`), with the values of keys that look like secrets
left out.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

MAX_TEXT = 200
MAX_ITEMS = 200
#: Keys whose values are not written: ``api_key``, ``password``, ``hf_token``, ...
SECRET_KEY = re.compile(r"pass(word|wd)?$|secret|token|api_?key|access_?key|credential", re.IGNORECASE)
HIDDEN = "<hidden>"


def config_record(
    train_loop_config: Mapping[str, Any] | None, configs: Mapping[str, Any], datasets: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``config`` field of a run record.

    Args:
        train_loop_config: The dict the train function gets.
        configs: The trainer's config objects by name (``scaling_config``, ``run_config``, ...).
        datasets: The ``datasets=`` dict (only its names and types are kept).
    """
    return {
        "train_loop_config": plain(dict(train_loop_config or {})),
        **{name: plain(config) for name, config in configs.items()},
        "datasets": {name: type(dataset).__name__ for name, dataset in datasets.items()},
    }


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON can hold it (see the module's docstring)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if not isinstance(value, str) else _cut(value)
    if depth > 6:
        return _cut(repr(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {item.name: getattr(value, item.name) for item in dataclasses.fields(value) if item.repr}
    if isinstance(value, Mapping):
        return {
            str(key): HIDDEN if SECRET_KEY.search(str(key)) else plain(item, depth + 1)
            for key, item in list(value.items())[:MAX_ITEMS]
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(item, depth + 1) for item in list(value)[:MAX_ITEMS]]
    return _cut(repr(value))


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"
