"""Stand-ins for the names Ray Train deprecated: they import, so a Ray script loads, and fail
when used with a ``DeprecationWarning`` (raised, as Ray Train raises it) that says what to use
instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def _fail(name: str, replacement: str) -> NoReturn:
    raise DeprecationWarning(f"{name} is deprecated in Ray Train and not provided by lockstep. Instead: {replacement}")


def removed_function(name: str, replacement: str) -> Callable[..., NoReturn]:
    """A function called ``name`` that raises, on call, naming ``replacement``.

    Args:
        name: The full name users know it by, e.g. ``"lockstep.torch.accelerate"``.
        replacement: What to do instead, in a sentence.
    """
    short_name = name.rsplit(".", 1)[-1]

    def removed(*args: Any, **kwargs: Any) -> NoReturn:
        _fail(name, replacement)

    removed.__name__ = removed.__qualname__ = short_name
    removed.__doc__ = f"Deprecated (Ray Train): raises. Instead: {replacement}"
    return removed


class _RemovedClassMeta(type):
    """Makes a class that fails when instantiated or when any public attribute is read
    (``TorchCheckpoint.from_state_dict(...)``), but still works in ``isinstance`` checks."""

    _removed_name: str
    _replacement: str

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        _fail(cls._removed_name, cls._replacement)

    def __getattr__(cls, attribute: str) -> NoReturn:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        _fail(f"{cls._removed_name}.{attribute}", cls._replacement)


def removed_class(name: str, replacement: str) -> type:
    """A class called ``name`` that raises when instantiated or its methods are used, naming
    ``replacement``.

    Args:
        name: The full name users know it by, e.g. ``"lockstep.torch.TorchCheckpoint"``.
        replacement: What to do instead, in a sentence.
    """
    short_name = name.rsplit(".", 1)[-1]
    namespace = {
        "_removed_name": name,
        "_replacement": replacement,
        "__doc__": f"Deprecated (Ray Train): raises when used. Instead: {replacement}",
        "__module__": name.rsplit(".", 1)[0],
    }
    return _RemovedClassMeta(short_name, (), namespace)


__all__ = ["removed_class", "removed_function"]
