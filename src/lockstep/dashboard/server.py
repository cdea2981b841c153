"""Serving the dashboard with uvicorn: bound to loopback unless told otherwise, and then only with
a token (one is made up when none is given)."""

from __future__ import annotations

import ipaddress
import secrets
import socket
from collections.abc import Callable

from lockstep.dashboard.store import RunStore

__all__ = ["DEFAULT_PORT", "is_loopback", "serve"]

DEFAULT_PORT = 8267


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback address (only local programs reach it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    storage_path: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve the dashboard of the runs under ``storage_path`` until interrupted (Ctrl-C).

    Args:
        storage_path: A local folder or a URI (``s3://bucket/prefix``).
        host: The address to listen on; anything but loopback needs a token.
        port: The port (0: a free one).
        token: What a browser must present; made up when ``host`` is not loopback and none is given.
        announce: Called once with the dashboard's URL (with the token), when it listens.

    Raises:
        FileNotFoundError: ``storage_path`` is not a folder.
        OSError: the port can't be bound.
    """
    import uvicorn

    from lockstep.dashboard.app import create_app

    store = RunStore(storage_path)
    if not store.filesystem.isdir(store.root):
        raise FileNotFoundError(f"{storage_path!r} is not a folder; pass the storage_path your runs used.")
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(24)
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind((host, port))
    listening.listen(128)  # connections wait in the backlog from now on, until uvicorn accepts them
    shown_host = socket.gethostname() if host in ("0.0.0.0", "::") else host
    shown_host = f"[{shown_host}]" if ":" in shown_host else shown_host
    announce(f"http://{shown_host}:{listening.getsockname()[1]}/" + (f"?token={token}" if token else ""))
    config = uvicorn.Config(create_app(store, token), log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[listening])
