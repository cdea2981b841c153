"""Files on any fsspec filesystem: paths and URIs to filesystems, and copying folders between
local disk and remote storage. The layer below both the run folder (storage.py) and Checkpoint."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from typing import Any

import fsspec
from fsspec.implementations.arrow import ArrowFSWrapper
from fsspec.implementations.local import LocalFileSystem

from lockstep._internal.persist.retry import StorageRetry

#: The retrying of storage operations that no run storage names (``Checkpoint.to_directory()``
#: & co.); on a rank, its run's (see :func:`use_retry_by_default`).
_DEFAULT_RETRY = StorageRetry()


def use_retry_by_default(retry: StorageRetry) -> None:
    """Retry this process's checkpoint reads that name no run (a rank reading the checkpoint it
    resumes from) as ``retry`` does: with its bound, in its outages."""
    global _DEFAULT_RETRY
    _DEFAULT_RETRY = retry


def default_retry() -> StorageRetry:
    """The retry of this process's storage reads that name no run (see :func:`use_retry_by_default`)."""
    return _DEFAULT_RETRY


def resolve_filesystem(path: str | os.PathLike[str], filesystem: Any = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Turn a local path or URI (``s3://…``) into ``(filesystem, path on that filesystem)``.

    ``filesystem`` may be an fsspec filesystem or, as Ray Train takes, a ``pyarrow.fs``
    filesystem; see :func:`from_pyarrow`.

    Raises:
        ValueError: ``filesystem`` is neither an fsspec nor a pyarrow filesystem.
    """
    path = os.fspath(path)
    if filesystem is None:
        if "://" not in path:
            return _local(path)
        return fsspec.core.url_to_fs(path)
    if is_pyarrow_filesystem(filesystem):
        return from_pyarrow(filesystem, path)
    if not isinstance(filesystem, fsspec.AbstractFileSystem):
        raise ValueError(
            f"filesystem={type(filesystem).__name__} is not a filesystem lockstep can use: pass an fsspec "
            "filesystem (e.g. s3fs.S3FileSystem(...)) or a pyarrow.fs one (e.g. pyarrow.fs.S3FileSystem(...))."
        )
    return filesystem, filesystem._strip_protocol(path)


def _local(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def is_pyarrow_filesystem(filesystem: Any) -> bool:
    """Whether ``filesystem`` is a ``pyarrow.fs.FileSystem`` (checked without importing pyarrow)."""
    pyarrow_fs = sys.modules.get("pyarrow.fs") or sys.modules.get("pyarrow._fs")
    file_system_type = getattr(pyarrow_fs, "FileSystem", None)
    return file_system_type is not None and isinstance(filesystem, file_system_type)


def from_pyarrow(filesystem: Any, path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """A ``pyarrow.fs`` filesystem and a path on it, as fsspec sees them.

    The filesystem is wrapped in fsspec's own ``ArrowFSWrapper``, with three simplifications
    so lockstep treats the storage for what it is: a ``LocalFileSystem`` is this machine's disk
    (fsspec's local filesystem, so the run record is replaced atomically and the report history
    appended to); a ``SubTreeFileSystem`` is its base filesystem with the base path in front of
    ``path`` (a subtree of S3 is still S3: no folders made on it, URIs with ``s3://``); and a
    ``PyFileSystem`` around an fsspec filesystem is that fsspec filesystem.
    """
    import pyarrow.fs as pafs

    if isinstance(filesystem, pafs.SubTreeFileSystem):
        return from_pyarrow(filesystem.base_fs, _path_in_subtree(filesystem, path))
    if isinstance(filesystem, pafs.PyFileSystem) and isinstance(filesystem.handler, pafs.FSSpecHandler):
        return resolve_filesystem(path, filesystem.handler.fs)
    if isinstance(filesystem, pafs.LocalFileSystem):
        return _local(path)
    wrapper = ArrowFSWrapper(filesystem)
    return wrapper, wrapper._strip_protocol(path)


def _path_in_subtree(subtree: Any, path: str) -> str:
    """``path`` inside a ``SubTreeFileSystem`` as a path on its base filesystem. Paths lockstep
    shows (``Result.path``: a URI, or an absolute local path under the base) are already there."""
    import pyarrow.fs as pafs

    base = subtree.base_path.rstrip("/") + "/"
    already_there = "://" in path or (
        isinstance(subtree.base_fs, pafs.LocalFileSystem) and (path.rstrip("/") + "/").startswith(base)
    )
    if already_there:
        return path
    return join(base, path) if path.strip("/") else base


OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"}


def is_object_store(filesystem: fsspec.AbstractFileSystem) -> bool:
    """Whether paths on ``filesystem`` start with a bucket (which lockstep never creates)."""
    protocols = filesystem.protocol if isinstance(filesystem.protocol, (tuple, list)) else (filesystem.protocol,)
    return bool(OBJECT_STORE_PROTOCOLS & set(protocols))


def is_local(filesystem: fsspec.AbstractFileSystem) -> bool:
    """Whether ``filesystem`` is this machine's own disk."""
    return isinstance(filesystem, LocalFileSystem)


def download_directory(
    filesystem: fsspec.AbstractFileSystem,
    source: str,
    local_dir: str,
    retry: StorageRetry | None = None,
    operation: str = "download_checkpoint",
) -> None:
    """Copy the folder ``source`` on ``filesystem`` into the local folder ``local_dir`` (each
    remote listing and file retried through ``retry``, a default one when None, and counted as
    ``operation``)."""
    if is_local(filesystem):
        shutil.copytree(source, local_dir, dirs_exist_ok=True)
        return
    retry = retry or _DEFAULT_RETRY
    shown = shown_path(filesystem, source)
    for remote in retry.call(operation, shown, functools.partial(filesystem.find, source)):
        relative = remote[len(source.rstrip("/")) + 1 :]
        local = os.path.join(local_dir, *relative.split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        retry.call(operation, shown, functools.partial(filesystem.get_file, remote, local))


def folder_size(folder: str) -> int:
    """The bytes of the files in a local folder."""
    walked = os.walk(folder, followlinks=True)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, files in walked for name in files)


def shown_path(filesystem: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` as a user writes it: a local path, or a URI (``s3://…``)."""
    return path if is_local(filesystem) else filesystem.unstrip_protocol(path)


def join(*parts: str) -> str:
    """Join path parts with '/', the separator every fsspec filesystem understands."""
    return "/".join([parts[0].rstrip("/"), *(part.strip("/") for part in parts[1:])])


def make_temp_dir(prefix: str) -> str:
    """A fresh local temporary folder."""
    return tempfile.mkdtemp(prefix=prefix)
