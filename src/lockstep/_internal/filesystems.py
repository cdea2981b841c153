"""Files on any fsspec filesystem: paths and URIs to filesystems, and copying folders between
local disk and remote storage. The layer below both the run folder (storage.py) and Checkpoint."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


def resolve_filesystem(path: str | os.PathLike[str], filesystem: Any = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Turn a local path or URI (``s3://…``) into ``(filesystem, path on that filesystem)``."""
    path = os.fspath(path)
    if filesystem is not None:
        return filesystem, filesystem._strip_protocol(path)
    if "://" not in path:
        return LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    return fsspec.core.url_to_fs(path)


OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"}


def is_object_store(filesystem: fsspec.AbstractFileSystem) -> bool:
    """Whether paths on ``filesystem`` start with a bucket (which lockstep never creates)."""
    protocols = filesystem.protocol if isinstance(filesystem.protocol, (tuple, list)) else (filesystem.protocol,)
    return bool(OBJECT_STORE_PROTOCOLS & set(protocols))


def is_local(filesystem: fsspec.AbstractFileSystem) -> bool:
    """Whether ``filesystem`` is this machine's own disk."""
    return isinstance(filesystem, LocalFileSystem)


def upload_directory(local_dir: str, filesystem: fsspec.AbstractFileSystem, destination: str) -> None:
    """Copy a local folder's files into ``destination`` on ``filesystem`` (merging with what is there)."""
    if is_local(filesystem):
        shutil.copytree(local_dir, destination, dirs_exist_ok=True)
        return
    for root, _, files in os.walk(local_dir):
        relative = os.path.relpath(root, local_dir)
        target = destination if relative == "." else join(destination, relative.replace(os.sep, "/"))
        if not is_object_store(filesystem):
            filesystem.makedirs(target, exist_ok=True)
        for name in files:
            filesystem.put_file(os.path.join(root, name), join(target, name))


def download_directory(filesystem: fsspec.AbstractFileSystem, source: str, local_dir: str) -> None:
    """Copy the folder ``source`` on ``filesystem`` into the local folder ``local_dir``."""
    if is_local(filesystem):
        shutil.copytree(source, local_dir, dirs_exist_ok=True)
        return
    for remote in filesystem.find(source):
        relative = remote[len(source.rstrip("/")) + 1:]
        local = os.path.join(local_dir, *relative.split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        filesystem.get_file(remote, local)


def join(*parts: str) -> str:
    """Join path parts with '/', the separator every fsspec filesystem understands."""
    return "/".join([parts[0].rstrip("/"), *(part.strip("/") for part in parts[1:])])


def make_temp_dir(prefix: str) -> str:
    """A fresh local temporary folder."""
    return tempfile.mkdtemp(prefix=prefix)
