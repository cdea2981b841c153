"""A report's metrics as JSON: checked (a dict with string keys, values JSON can hold), with
one-element tensors and numpy scalars turned into plain numbers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def encode_metrics(metrics: Mapping[str, Any]) -> str:
    """Check the metrics of a report and return them as JSON.

    Tensors and numpy scalars with one element become plain numbers.

    Raises:
        TypeError: ``metrics`` is not a dict, a key is not a string, or a value can't be saved.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"report() takes a dict of metrics, got {type(metrics).__name__}.")
    plain: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"report(): metric names must be strings, got the key {key!r} ({type(key).__name__}).")
        plain[key] = _plain_value(value, key)
    return json.dumps(plain)


def _plain_value(value: Any, key: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain_value(v, key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_value(item, key) for item in value]
    if _is_one_element_array(value):
        return _plain_value(value.item(), key)
    raise TypeError(
        f"report(): metric {key!r} is a {type(value).__name__}, which can't be saved; report numbers, "
        "strings, or lists/dicts of them (use tensor.item() for a scalar tensor)."
    )


def _is_one_element_array(value: Any) -> bool:
    numel = getattr(value, "numel", None)
    if callable(numel):
        return numel() == 1
    return getattr(value, "size", None) == 1 and hasattr(value, "item")
