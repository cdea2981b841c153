"""Whether a file belongs to this Python's installation (the standard library and site-packages:
a venv's, its base interpreter's, the user's ``pip install --user`` ones) or to the user's own
files. The warm start imports only installed packages ahead of a job and leaves the user's modules
to the workers, which read them afresh; the fast exit lets go of the user's modules only."""

from __future__ import annotations

import functools
import os
import site
import sys

__all__ = ["installation_roots", "installed_file"]


@functools.cache
def installation_roots() -> tuple[str, ...]:
    """The folders this Python's installed modules live under (absolute, each ending with a separator)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *getattr(site, "getsitepackages", list)()}
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    return tuple(sorted({os.path.join(os.path.abspath(root), "") for root in roots if root}))


def installed_file(path: str) -> bool:
    """Whether ``path`` lies under one of :func:`installation_roots` (a folder of that name
    beside one, ``/opt/venv2`` next to ``/opt/venv``, does not count)."""
    return os.path.join(os.path.abspath(path), "").startswith(installation_roots())
