"""Whether the Ray executor forks its ranks on their nodes, and the warm process of each node
(see :mod:`lockstep._internal.ray_compat.ray_fork`).

A forked rank is not a Ray worker, so the ranks run in their actors when the job may call Ray:
the run gives the ranks Ray Datasets, or the train function (or a function of the user's that it
calls, or its config) names Ray. That check reads the names the functions' code uses; a Ray call
hidden deeper (in a module of the user's that the function imports) is not seen:
``LOCKSTEP_RAY_FORK=0`` then runs the ranks in their actors.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

from lockstep._internal.executors.ray_placement import RankPlace
from lockstep._internal.ray_compat.ray_fork import fork_requested
from lockstep._internal.run.worker_group import GroupSpec
from lockstep._internal.warm.preload import preload_modules

__all__ = ["forks_ranks", "names_ray", "start_forkers"]

logger = logging.getLogger(__name__)


def forks_ranks(spec: GroupSpec, shards: list[dict[str, Any]], job_names_ray: str | None) -> bool:
    """Whether the ranks run forked on their node: ``LOCKSTEP_RAY_FORK`` is not off, and the run
    gives them no GPUs and no Ray Datasets (``shards``), and the job names no Ray (``job_names_ray``:
    where it does, see :func:`names_ray`)."""
    if not fork_requested():
        return False
    why = "it gives them GPUs" if spec.use_gpu else "it gives them Ray Datasets" if any(shards) else job_names_ray
    if why is not None:
        logger.info("The ranks run in their Ray actors, not forked on their nodes: %s.", why)
        return False
    return True


def names_ray(train_fn: Callable[..., Any], config: dict[str, Any] | None) -> str | None:
    """Where the train function, the functions of its module that it calls (at any depth), or
    its config name Ray (a module, a function or object of Ray's, ``import ray``); None if
    nowhere."""
    for key, value in (config or {}).items():
        if _is_rays(value) or (isinstance(value, (dict, list, tuple)) and any(map(_is_rays, _items(value)))):
            return f"train_loop_config[{key!r}] holds Ray's {type(value).__name__}"
    seen: set[int] = set()
    pending = [train_fn]
    while pending:
        function = inspect.unwrap(pending.pop())
        if not inspect.isfunction(function) or id(function) in seen:
            continue
        seen.add(id(function))
        for name, value in _referenced(function):
            if name.split(".")[0] == "ray" or _is_rays(value):
                return f"{function.__qualname__} names {name!r} (set LOCKSTEP_RAY_FORK=0 if that is all)"
            if inspect.isfunction(value) and value.__module__ == function.__module__:
                pending.append(value)
    return None


def _referenced(function: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """The global and closure names ``function``'s code (nested code included) uses, with their values."""
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=True))
    codes = [function.__code__]
    while codes:
        code = codes.pop()
        codes += [constant for constant in code.co_consts if isinstance(constant, types.CodeType)]
        for name in code.co_names:
            yield name, function.__globals__.get(name)
        for name in code.co_freevars:
            cell = cells.get(name)
            yield name, cell.cell_contents if cell is not None and _filled(cell) else None


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _is_rays(value: Any) -> bool:
    """Whether ``value`` is a Ray module, or a function, class or object of Ray's."""
    if isinstance(value, types.ModuleType):
        return value.__name__.split(".")[0] == "ray"
    owner = value if inspect.isfunction(value) or inspect.isclass(value) else type(value)
    return str(getattr(owner, "__module__", "") or "").split(".")[0] == "ray"


def _items(container: dict[str, Any] | list[Any] | tuple[Any, ...]) -> list[Any]:
    return list(container.values()) if isinstance(container, dict) else list(container)


def start_forkers(
    places: list[RankPlace], actors: list[Any], payload: bytes, get: Callable[[list[Any], str], list[Any]]
) -> dict[str, str]:
    """Have the actor of each node's first rank start that node's warm process, which imports
    what the job needs (``payload``'s installed modules, Ray's left out); the socket name of
    each, by node id. ``get`` waits for Ray's answers (with the placement timeout)."""
    firsts: dict[str, Any] = {}
    for rank, actor in zip(places, actors, strict=True):
        firsts.setdefault(rank.place.node_id, actor)
    modules = [name for name in preload_modules(payload) if name.split(".")[0] != "ray"]
    names = get([actor.start_forker.remote(modules) for actor in firsts.values()], "start warm processes")
    return dict(zip(firsts, names, strict=True))
