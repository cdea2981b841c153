"""How a public class of :mod:`lockstep.lightning` becomes a class of one Lightning package.

``RayDDPStrategy`` and its siblings are created with :class:`PackageBound` as metaclass. Calling
one (or a user's subclass of one) picks the Lightning package of the calling code (see
:mod:`lockstep.lightning._package`) and instantiates a class that derives from both the class
called and lockstep's implementation for that package. So the object is an instance of the
public class (``isinstance(strategy, RayDDPStrategy)`` holds), of the user's subclass, and of
that package's ``DDPStrategy``, which its ``Trainer`` checks.
"""

from __future__ import annotations

import abc
import sys
import threading
import types
from typing import Any

from lockstep.lightning._package import choose_package

_bound: dict[tuple[type, str], type] = {}
_lock = threading.Lock()


class PackageBound(abc.ABCMeta):
    """Metaclass of the package-neutral public classes; see the module doc."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        """Instantiate ``cls`` for the Lightning package of the caller."""
        if package_of(cls) is not None:
            return super().__call__(*args, **kwargs)
        caller = sys._getframe(1)
        package = choose_package(caller.f_globals, caller.f_locals)
        return bound_class(cls, package)(*args, **kwargs)


def package_of(cls: type) -> str | None:
    """The Lightning package ``cls`` is built for, or None for a package-neutral class."""
    return getattr(cls, "_lockstep_package", None)


def bound_class(cls: type, package: str) -> type:
    """``cls`` joined with lockstep's implementation of its role for ``package`` (cached)."""
    key = (cls, package)
    with _lock:
        if key not in _bound:
            _bound[key] = _make_bound(cls, package)
        return _bound[key]


def _make_bound(cls: type, package: str) -> type:
    from lockstep.lightning._classes import classes_for

    implementation = getattr(classes_for(package), cls._lockstep_role)  # type: ignore[attr-defined]

    def fill(namespace: dict[str, Any]) -> None:
        # The public name, so Lightning's callback state key is the same as under Ray Train.
        namespace.update(
            __module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__, _lockstep_package=package
        )

    return types.new_class(cls.__name__, (cls, implementation), exec_body=fill)
