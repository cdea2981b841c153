"""``lockstep dashboard``: a read-only web dashboard over a storage path (a local folder or an
object store URI such as ``s3://bucket/prefix``): the runs, each run's live curves, ranks,
checkpoints, errors, logs and config, and several runs side by side.

It reads what runs write to storage and never talks to a run's driver or ranks. Needs
``pip install 'lockstep[dashboard]'`` (Starlette and uvicorn); the page's scripts and styles are
served from this package, so the browser fetches nothing from elsewhere.

Example:
    >>> from lockstep.dashboard import serve
    >>> serve("~/lockstep_results", port=8267)  # doctest: +SKIP
"""

from __future__ import annotations

from lockstep.dashboard.server import DEFAULT_PORT, serve

__all__ = ["DEFAULT_PORT", "serve"]
