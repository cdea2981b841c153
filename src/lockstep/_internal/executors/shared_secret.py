"""How torchrun's ranks learn the channel secret without the rendezvous store.

Anyone who reaches torchrun's store (``MASTER_ADDR:MASTER_PORT``) can read and write it, so the
store carries only what is harmless to read: the *name* of a file. Rank 0 writes the run's secret
and its channel's address into that file in the run folder, a storage every rank must share
anyway (lockstep refuses a multi-node run on node-local storage); the other ranks read both there
and derive their own credential from the secret. So a peer that knows the store and not the
storage can't open a channel, and the store's writer can't point the ranks at an address of its
own (where it could relay their handshake to rank 0 and then speak for rank 0); it can at worst
name a file that isn't there (the run then fails, it runs nothing).

On local disk the file is made readable by its owner only (mode 0600). Rank 0 removes it when
the run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from typing import NamedTuple

from lockstep._internal.persist.filesystems import is_local
from lockstep._internal.persist.storage import RunStorage

SECRET_FOLDER = ".lockstep"
SECRET_FILE_NAME = re.compile(r"^channel-[0-9a-f]{32}\.key$")


class ChannelSecret(NamedTuple):
    """What rank 0 tells the other ranks through the run folder: the secret and where its channel is."""

    secret: bytes
    address: str


def write_secret(storage: RunStorage, secret: bytes, address: str) -> str:
    """Write ``secret`` and the channel's ``address`` (``host:port``) into a new file of the run
    folder; return the file's name."""
    name = f"channel-{secrets.token_hex(16)}.key"
    path = storage.path_of(SECRET_FOLDER, name)
    text = json.dumps({"secret": secret.hex(), "address": address})
    if is_local(storage.filesystem):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
    else:
        storage.filesystem.pipe_file(path, text.encode())
    return name


def read_secret(storage: RunStorage, name: str) -> ChannelSecret:
    """The secret and channel address rank 0 wrote in file ``name``.

    Raises:
        ValueError: ``name`` is not a name :func:`write_secret` makes (the store was tampered
            with), or the file is not what it writes.
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
            entry = json.loads(handle.read())
        return ChannelSecret(bytes.fromhex(entry["secret"]), str(entry["address"]))
    except (TypeError, KeyError) as error:
        raise ValueError(f"{path} is not a channel secret lockstep wrote") from error
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
