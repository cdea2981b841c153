"""How torchrun's ranks learn the channel secret without the rendezvous store.

Anyone who reaches torchrun's store (``MASTER_ADDR:MASTER_PORT``) can read and write it, so the
store carries only what is harmless to read: the channel's address and the *name* of a file.
Rank 0 writes the run's secret into that file in the run folder, a storage every rank must
share anyway (lockstep refuses a multi-node run on node-local storage); the other ranks read
it there and derive their own credential from it. So a peer that knows the store and not the
storage can't open a channel; the store's writer can at worst point ranks at a file or address
that fails the handshake (the run then fails, it runs nothing).

On local disk the file is made readable by its owner only (mode 0600). Rank 0 removes it when
the run ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets

from lockstep._internal.persist.filesystems import is_local
from lockstep._internal.persist.storage import RunStorage

SECRET_FOLDER = ".lockstep"
SECRET_FILE_NAME = re.compile(r"^channel-[0-9a-f]{32}\.key$")


def write_secret(storage: RunStorage, secret: bytes) -> str:
    """Write ``secret`` into a new file of the run folder; return the file's name."""
    name = f"channel-{secrets.token_hex(16)}.key"
    path = storage.path_of(SECRET_FOLDER, name)
    if is_local(storage.filesystem):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secret.hex())
    else:
        storage.filesystem.pipe_file(path, secret.hex().encode())
    return name


def read_secret(storage: RunStorage, name: str) -> bytes:
    """The secret rank 0 wrote in file ``name``.

    Raises:
        ValueError: ``name`` is not a name :func:`write_secret` makes (the store was tampered with).
        FileNotFoundError: the file is not there: this rank does not see rank 0's storage.
    """
    if not SECRET_FILE_NAME.match(name):
        raise ValueError(
            f"the rendezvous store names {name!r} as the channel's secret file, which lockstep never "
            "writes: something else wrote to torchrun's store"
        )
    storage.refresh()
    path = storage.path_of(SECRET_FOLDER, name)
    try:
        with storage.filesystem.open(path, "r") as handle:
            return bytes.fromhex(handle.read().strip())
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"rank 0's channel secret {path} is not on this rank's storage: every rank must see the same "
            "RunConfig.storage_path (a shared filesystem or an object store)"
        ) from error


def remove_secret(storage: RunStorage, name: str) -> None:
    """Remove the secret file ``name`` (once the run has ended); a missing one is fine."""
    path = storage.path_of(SECRET_FOLDER, name)
    with contextlib.suppress(FileNotFoundError):
        storage.filesystem.rm(path)
