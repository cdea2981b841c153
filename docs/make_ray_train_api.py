"""Writes docs/ray_train_api.md: every public name of Ray Train 2.60 (``ray.train`` and its
``torch``, ``lightning``, ``huggingface.transformers`` and ``collective`` modules, plus
``ray.air.session``) with what lockstep does with it.

The statuses come from ``lockstep._internal.ray_compat.ray_names`` (the list the tests check against the
code); modules it does not cover yet get theirs from ``FALLBACK`` below. Before writing, every
status is checked against the code: a name said to be provided (or deprecated) must import from
lockstep, one said not to be provided must not, and every name in Ray's ``__all__`` must have a
status. Ray's names are read from the installed Ray (the dev venv has 2.60).

    python docs/make_ray_train_api.py           # rewrite docs/ray_train_api.md
    python docs/make_ray_train_api.py --check   # exit 1 if the file is stale or a status is wrong
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

from lockstep._internal.ray_compat.ray_names import RAY_NAMES, NameStatus

DOC = Path(__file__).resolve().parent / "ray_train_api.md"
RAY_MODULES = ("ray.train", "ray.train.torch", "ray.train.lightning", "ray.train.huggingface.transformers",
               "ray.train.collective", "ray.air.session")
SWAP = {"ray.air.session": "lockstep.session"}

_PL_PACKAGE = "built for the Lightning package in use (lightning or pytorch_lightning)"
_PG = "the process group (backend, timeout) is TorchConfig's"
FALLBACK: dict[str, dict[str, NameStatus]] = {
    "ray.train.lightning": {
        "RayDDPStrategy": NameStatus("provided", "lockstep.lightning.RayDDPStrategy", f"{_PL_PACKAGE}; {_PG}"),
        "RayFSDPStrategy": NameStatus("provided", "lockstep.lightning.RayFSDPStrategy", f"{_PL_PACKAGE}; {_PG}"),
        "RayDeepSpeedStrategy": NameStatus("provided", "lockstep.lightning.RayDeepSpeedStrategy",
                                           f"{_PL_PACKAGE}; raises ImportError on creation when deepspeed is missing"),
        "RayLightningEnvironment": NameStatus("provided", "lockstep.lightning.RayLightningEnvironment", _PL_PACKAGE),
        "RayTrainReportCallback": NameStatus("provided", "lockstep.lightning.RayTrainReportCallback"),
        "prepare_trainer": NameStatus("provided", "lockstep.lightning.prepare_trainer",
                                      "a strategy or cluster environment that is not lockstep's raises ValueError "
                                      "(Ray: RuntimeError)"),
    },
    "ray.train.huggingface.transformers": {
        "RayTrainReportCallback": NameStatus("provided", "lockstep.huggingface.transformers.RayTrainReportCallback",
                                             "report_on='evaluate' or 'log' also reports (without a checkpoint) after "
                                             "each evaluation or log event; the default 'save' is Ray's behaviour"),
        "prepare_trainer": NameStatus("provided", "lockstep.huggingface.transformers.prepare_trainer"),
    },
    "ray.train.collective": {
        "barrier": NameStatus("provided", "lockstep.collective.barrier"),
        "broadcast_from_rank_zero": NameStatus("provided", "lockstep.collective.broadcast_from_rank_zero",
                                               "warns above 1 MB (Ray: above 1,000 bytes)"),
    },
}
HEADER = """# Ray Train 2.60's API in lockstep

Every public name of Ray Train 2.60 (`__all__` of `ray.train`, `ray.train.torch`,
`ray.train.lightning`, `ray.train.huggingface.transformers`, `ray.train.collective`, and the
functions of `ray.air.session`), and what lockstep does with it. The import swap is
`ray.train.X` -> `lockstep.X` (and `ray.air.session` -> `lockstep.session`).

- **same**: the lockstep name does what Ray's does.
- **different**: the lockstep name exists; the note says how it differs.
- **deprecated**: Ray Train deprecated it; lockstep's name imports and raises on use, saying what
  to use instead.
- **not provided**: importing it from lockstep fails; the note says what to use instead.

This file is written by `docs/make_ray_train_api.py` from `lockstep/_internal/ray_compat/ray_names.py`
(checked by the tests against the code); `python docs/make_ray_train_api.py --check` fails when
it is stale.
"""


def ray_names(module: str) -> list[str]:
    """The public names of a Ray module as the installed Ray exports them."""
    imported = importlib.import_module(module)
    if hasattr(imported, "__all__"):
        return sorted(imported.__all__)
    return sorted(name for name, value in vars(imported).items() if _own_public_function(value))


def _own_public_function(value: Any) -> bool:
    """A function marked ``@PublicAPI`` by Ray and defined in Ray Train (``ray.air.session``,
    which has no ``__all__``, re-exports the session functions with their imports)."""
    return (inspect.isfunction(value) and value.__module__.startswith("ray.train")
            and str(getattr(value, "_annotated_type", "")).endswith("PUBLIC_API"))


def statuses(module: str) -> dict[str, NameStatus]:
    """lockstep's status of each name of ``module``: ray_names' list, else FALLBACK."""
    return RAY_NAMES.get(module) or FALLBACK.get(module, {})


def resolve(path: str) -> Any:
    """The object at a dotted lockstep path such as ``lockstep.torch.prepare_model``.

    Raises:
        ImportError, AttributeError: nothing is there.
    """
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(f"no module in {path}")


def problems(module: str) -> list[str]:
    """What is wrong between Ray's names, the statuses and lockstep's code, for ``module``."""
    known = statuses(module)
    found = [f"{module}.{name}: no status" for name in ray_names(module) if name not in known]
    lockstep_module = SWAP.get(module, module.replace("ray.train", "lockstep", 1))
    for name, status in known.items():
        if status.status == "not provided":
            try:
                resolve(f"{lockstep_module}.{name}")
                found.append(f"{module}.{name}: said not provided, but {lockstep_module}.{name} exists")
            except (ImportError, AttributeError):
                pass
            continue
        try:
            resolve(status.lockstep)
        except (ImportError, AttributeError) as error:
            found.append(f"{module}.{name}: {status.lockstep} does not import ({type(error).__name__}: {error})")
    return found


def cell(status: NameStatus) -> str:
    """The status column of one name."""
    where = f"`{status.lockstep}`" if status.lockstep else ""
    if status.status == "provided":
        return f"same: {where}" if not status.note else f"different: {where}: {status.note}"
    if status.status == "deprecated":
        return f"deprecated: {where} imports and raises on use; instead: {status.note}"
    return f"not provided: {status.note}"


def table(module: str) -> str:
    """The section of one Ray module."""
    rows = [f"| `{module}.{name}` | {cell(status).replace('|', '/')} |" for name, status in sorted(statuses(module).items())]
    return "\n".join([f"## `{module}`", "", "| Ray Train | lockstep |", "|---|---|", *rows, ""])


def render() -> str:
    """The whole document."""
    return "\n".join([HEADER, *(table(module) for module in RAY_MODULES)])


def main() -> int:
    """Check the statuses, then write the document (or, with --check, compare it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the doc is stale or a status is wrong")
    check = parser.parse_args().check
    found = [problem for module in RAY_MODULES for problem in problems(module)]
    if found:
        print("\n".join(["ray_train_api: statuses disagree with the code:", *found]), file=sys.stderr)
        return 1
    text = render()
    if check:
        if DOC.read_text() != text:
            print(f"{DOC} is stale: run python docs/make_ray_train_api.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
