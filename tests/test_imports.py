"""lockstep's modules import each other without cycles, and the light entry points stay light.

Every import of a ``lockstep`` module counts: at module level, inside a function (a lazy import
hides a cycle from Python, not from the design) and under ``if TYPE_CHECKING:`` (a type-only
import is still a dependency of the design). So do package ``__init__`` files: importing
``lockstep.torch.train_loop_utils`` runs ``lockstep/torch/__init__.py`` first, so the importer
depends on that package and on what it imports. A module's own ancestor packages are left out
(they are already being imported when it runs), and so are edges to the root package
``lockstep`` (every import starts there).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO_ROOT

SOURCE_ROOT = REPO_ROOT / "src"
PACKAGE = "lockstep"

#: module name -> the lockstep modules it imports
Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    """``src/lockstep/_internal/persist/storage.py`` -> ``lockstep._internal.persist.storage``."""
    parts = list(path.relative_to(SOURCE_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package, by name."""
    return {module_name(path): path for path in sorted((SOURCE_ROOT / PACKAGE).rglob("*.py"))}


def is_type_checking_block(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth (TYPE_CHECKING blocks included)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from import_nodes(node)


def absolute_base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module a ``from … import`` names, with relative imports made absolute."""
    if not node.level:
        return node.module or ""
    anchor = importer.split(".")
    drop = node.level - 1 if is_package else node.level
    anchor = anchor[: len(anchor) - drop]
    return ".".join(anchor + ([node.module] if node.module else []))


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The lockstep modules one import statement loads: the named modules and the packages on
    their way, less the root package and ``importer``'s own ancestors (see the module docstring)."""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:
        base = absolute_base(node, importer, is_package)
        names = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    loaded = {name for name in names if name in modules}
    ancestors = {".".join(importer.split(".")[:depth]) for depth in range(1, importer.count(".") + 1)}
    for name in list(loaded):
        loaded |= {".".join(name.split(".")[:depth]) for depth in range(2, name.count(".") + 1)}
    return {name for name in loaded if name in modules and name != PACKAGE and name not in ancestors}


def import_graph() -> Graph:
    """Each lockstep module and the lockstep modules it imports."""
    modules = package_modules()
    graph: Graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set()
        for node in import_nodes(tree):
            graph[name] |= imported_modules(node, name, is_package, set(modules))
        graph[name].discard(name)
    return graph


def strongly_connected_components(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that reach each other (iterative, no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                components.append(pop_component(stack, on_stack, node))
    return components


def pop_component(stack: list[str], on_stack: set[str], root: str) -> list[str]:
    """Pop the modules down to ``root`` (the root of a component in Tarjan's algorithm) off the
    stack: that component, sorted."""
    component = []
    while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == root:
            break
    return sorted(component)


def one_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest import cycle through the first module of ``component``, as a path that ends
    where it starts."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    next_frontier.append(child)
        frontier = next_frontier
    raise AssertionError(f"{component} is not a cycle")


def import_cycles(graph: Graph) -> list[list[str]]:
    """One cycle per group of modules that import each other."""
    return [one_cycle(graph, component) for component in strongly_connected_components(graph) if len(component) > 1]


# -- the checks -------------------------------------------------------------------------------


def test_lockstep_has_no_import_cycles() -> None:
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles in src/lockstep (break them; a lazy import doesn't count):\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles
    )


def test_the_graph_sees_lazy_relative_from_type_checking_and_package_imports() -> None:
    modules = {
        "lockstep",
        "lockstep.a",
        "lockstep.b",
        "lockstep.sub",
        "lockstep.sub.c",
        "lockstep.sub.d",
        "lockstep.other",
        "lockstep.other.e",
    }
    source = (
        "from typing import TYPE_CHECKING\n"
        "import lockstep.a\n"
        "from . import d\n"
        "if TYPE_CHECKING:\n"
        "    import lockstep.b\n"
        "def later():\n"
        "    from lockstep.other.e import helper\n"
    )
    found: set[str] = set()
    for node in import_nodes(ast.parse(source)):
        found |= imported_modules(node, "lockstep.sub.c", False, modules)
    # lockstep.other is loaded on the way to lockstep.other.e; lockstep.sub (c's own package) and
    # the root package are not counted
    assert found == {"lockstep.a", "lockstep.b", "lockstep.sub.d", "lockstep.other", "lockstep.other.e"}


def test_every_group_of_modules_importing_each_other_is_reported() -> None:
    graph: Graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


LIGHT_ENTRY_POINTS = ("lockstep", "lockstep._internal.rank.worker", "lockstep.context")
DRIVER_STACK = (
    "lockstep._internal.run.driver",
    "lockstep._internal.run.controller",
    "lockstep.trainer",
    "lockstep._internal.executors",
)


@pytest.mark.parametrize("entry_point", LIGHT_ENTRY_POINTS)
def test_the_light_entry_points_do_not_load_the_driver_stack(entry_point: str) -> None:
    probe = (
        f"import sys, {entry_point}\n"
        "import json; print(json.dumps(sorted(name for name in sys.modules if name.startswith('lockstep'))))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LOCKSTEP_WARM_START": "0"},
        check=True,
    )
    loaded = json.loads(completed.stdout)
    assert not [name for name in loaded if name.startswith(DRIVER_STACK)], (
        f"importing {entry_point} loads the driver stack: {loaded}"
    )


OPTIONAL_SERVERS = ("starlette", "uvicorn", "prometheus_client")


def loaded_modules(entry_point: str) -> list[str]:
    probe = f"import sys, {entry_point}\nimport json; print(json.dumps(sorted(sys.modules)))"
    completed = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LOCKSTEP_WARM_START": "1"},
        check=True,
    )
    return json.loads(completed.stdout)


@pytest.mark.parametrize("entry_point", ["lockstep", "lockstep._internal.run.driver"])
def test_lockstep_and_its_driver_load_no_web_framework_nor_prometheus_client(entry_point: str) -> None:
    loaded = loaded_modules(entry_point)
    assert not [name for name in loaded if name.split(".")[0] in OPTIONAL_SERVERS], (
        f"importing {entry_point} loads an optional server package"
    )


def test_the_dashboard_loads_neither_the_driver_nor_the_warm_start_nor_torch() -> None:
    loaded = loaded_modules("lockstep.dashboard.app")
    assert not [name for name in loaded if name.startswith((*DRIVER_STACK, "lockstep._internal.warm", "torch"))], (
        "the dashboard only reads storage"
    )


# -- the shape of the public modules -----------------------------------------------------------


def public_modules() -> dict[str, Path]:
    """The modules a user may import: outside ``_internal`` and with no leading underscore."""
    return {
        name: path
        for name, path in package_modules().items()
        if "._internal" not in name and not any(part.startswith("_") for part in name.split("."))
    }


def test_every_public_module_says_what_it_exports() -> None:
    missing = [
        name
        for name, path in public_modules().items()
        if not any(
            isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.unparse(node).split("=")[0]
            for node in ast.parse(path.read_text(encoding="utf-8")).body
        )
    ]
    assert not missing, f"public modules without __all__: {missing}"


#: Calls that take their arguments by position by nature: logging's and printf-style calls, C functions.
POSITIONAL_BY_NATURE = {"debug", "info", "warning", "error", "exception", "log_clear_of_line", "prctl", "pack"}


def test_calls_with_five_or_more_arguments_name_them() -> None:
    found = []
    for name, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and len(node.args) >= 5:
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if called not in POSITIONAL_BY_NATURE:
                    found.append(f"{name}:{node.lineno} {called}")
    assert not found, f"calls passing 5 or more arguments by position (pass them by keyword): {found}"


#: The house's length for a module (ROUND3: modules past ~350 lines are split by role).
MODULE_LINES_LIMIT = 360


def test_no_module_grows_past_the_house_length() -> None:
    long = {
        name: lines
        for name, path in package_modules().items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES_LIMIT
    }
    assert not long, f"modules over {MODULE_LINES_LIMIT} lines (split them by role): {long}"
