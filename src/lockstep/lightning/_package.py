"""Which Lightning package a user's code trains with: ``lightning`` (``import lightning.pytorch
as pl``) or ``pytorch_lightning``.

The two packages hold the same classes under different names, and a ``Trainer`` of one refuses
the strategies, plugins and callbacks of the other. So lockstep's Lightning classes are built
for one package when the user creates one of them (see :mod:`lockstep.lightning._binding`), and
the package is the one the user's code uses, found in this order:

1. ``LOCKSTEP_LIGHTNING_PACKAGE`` (``lightning`` or ``pytorch_lightning``), when set;
2. the package that the calling code refers to (its module's globals and the function's locals:
   the ``pl`` module, the ``Trainer`` class, the ``LightningModule`` subclass or its instance),
   when it refers to exactly one;
3. the package that has been imported, when exactly one has;
4. ``lightning`` when it is installed (Ray Train's preference), else ``pytorch_lightning``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

LIGHTNING = "lightning"
PYTORCH_LIGHTNING = "pytorch_lightning"
PACKAGES = (LIGHTNING, PYTORCH_LIGHTNING)
ENV_PACKAGE = "LOCKSTEP_LIGHTNING_PACKAGE"

#: The trainer module of each package (what users import as ``pl``).
_TRAINER_MODULES = {LIGHTNING: "lightning.pytorch", PYTORCH_LIGHTNING: "pytorch_lightning"}
#: The module that holds each package's cluster environments.
_ENVIRONMENT_MODULES = {
    LIGHTNING: "lightning.fabric.plugins.environments",
    PYTORCH_LIGHTNING: "lightning_fabric.plugins.environments",
}


def installed_packages() -> list[str]:
    """The Lightning packages that can be imported here, ``lightning`` first."""
    return [name for name in PACKAGES if importlib.util.find_spec(name) is not None]


def trainer_module(package: str) -> ModuleType:
    """``lightning.pytorch`` or ``pytorch_lightning`` (imported on first use)."""
    return importlib.import_module(_TRAINER_MODULES[package])


def environments_module(package: str) -> ModuleType:
    """The module with the package's ``LightningEnvironment``."""
    return importlib.import_module(_ENVIRONMENT_MODULES[package])


def choose_package(caller_globals: Mapping[str, Any], caller_locals: Mapping[str, Any]) -> str:
    """The package to build lockstep's Lightning classes for (the order is in the module doc).

    Raises:
        ValueError: ``LOCKSTEP_LIGHTNING_PACKAGE`` names something else.
        ModuleNotFoundError: neither package is installed.
    """
    chosen = os.environ.get(ENV_PACKAGE)
    if chosen:
        return _checked_choice(chosen)
    referenced = packages_referenced(list(caller_locals.values()) + list(caller_globals.values()))
    if len(referenced) == 1:
        return referenced.pop()
    imported = {name for name in PACKAGES if _TRAINER_MODULES[name] in sys.modules}
    if len(imported) == 1:
        return imported.pop()
    return _default_package(ambiguous=len(imported) == 2)


def _checked_choice(chosen: str) -> str:
    if chosen not in PACKAGES:
        raise ValueError(
            f"{ENV_PACKAGE}={chosen!r} is not a Lightning package; set it to one of {', '.join(PACKAGES)}."
        )
    return chosen


def _default_package(ambiguous: bool) -> str:
    installed = installed_packages()
    if not installed:
        raise ModuleNotFoundError(
            "lockstep.lightning needs PyTorch Lightning: pip install lightning (or pytorch-lightning)."
        )
    if ambiguous:
        logger.warning(
            "Both lightning and pytorch_lightning are imported and the calling code refers to neither; "
            "using %s. Set %s=pytorch_lightning (or lightning) to choose.",
            installed[0],
            ENV_PACKAGE,
        )
    return installed[0]


def packages_referenced(values: Iterable[Any]) -> set[str]:
    """The Lightning packages that these objects (modules, classes, functions, instances) come from."""
    found: set[str] = set()
    for value in values:
        try:
            package = _package_of(value)
        except Exception:  # an object whose attribute lookup fails tells us nothing
            continue
        if package is not None:
            found.add(package)
    return found


def _package_of(value: Any) -> str | None:
    if isinstance(value, ModuleType):
        return _package_of_module_name(value.__name__)
    if isinstance(value, type):
        return _package_of_class(value)
    if callable(value):
        module_name = getattr(value, "__module__", None)
        found = _package_of_module_name(module_name) if isinstance(module_name, str) else None
        return found if found is not None else _package_of_class(type(value))
    return _package_of_class(type(value))


def _package_of_class(cls: type) -> str | None:
    for klass in getattr(cls, "__mro__", ()):
        package = _package_of_module_name(getattr(klass, "__module__", None) or "")
        if package is not None:
            return package
    return None


def _package_of_module_name(name: str) -> str | None:
    if name == PYTORCH_LIGHTNING or name.startswith(PYTORCH_LIGHTNING + "."):
        return PYTORCH_LIGHTNING
    if name in ("lightning", "lightning.pytorch") or name.startswith("lightning.pytorch."):
        return LIGHTNING
    return None
