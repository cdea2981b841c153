"""Copying one rank's checkpoint folder into storage, several files at once, with each file's
size and checksum for the checkpoint's manifest (manifest.py).

The copy itself is the filesystem's fastest (``copy_file_range``/``sendfile`` on local disk,
fsspec's ``put_file`` with multipart uploads elsewhere), so the bytes do not pass through Python;
each file is checksummed from the source at the same time, on other threads (checksums.py: XXH3 at
about 10 GB/s on the page cache's copy of the file, which the copy has just read).
"""

from __future__ import annotations

import functools
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor

import fsspec

from lockstep._internal.persist.checksums import checksum_of_file
from lockstep._internal.persist.filesystems import folder_size, is_local, is_object_store, join, shown_path
from lockstep._internal.persist.manifest import UNLISTED, FileSum
from lockstep._internal.persist.retry import StorageRetry

#: What the retries of a checkpoint's copy are counted and logged as.
OPERATION = "upload_checkpoint"

#: At most this many files are copied (and checksummed) at the same time.
MAX_THREADS = 8
#: Set to 0 in a rank's environment to copy without checksums, so no manifest is written (for
#: benchmarks/checkpoint_bench.py, which measures what the checksums cost; not for real runs).
CHECKSUMS_VARIABLE = "LOCKSTEP_CHECKPOINT_CHECKSUMS"


def files_of(local_dir: str) -> list[tuple[str, str]]:
    """``(local path, relative path with '/')`` of every file under ``local_dir``."""
    found = []
    for root, _, names in os.walk(local_dir):
        relative_root = os.path.relpath(root, local_dir)
        for name in names:
            relative = name if relative_root == "." else f"{relative_root.replace(os.sep, '/')}/{name}"
            found.append((os.path.join(root, name), relative))
    return sorted(found, key=lambda item: item[1])


def _make_folders(
    local_dir: str, filesystem: fsspec.AbstractFileSystem, destination: str, retry: StorageRetry, operation: str
) -> None:
    """Create ``destination`` and its subfolders (object stores have none to create)."""
    if is_object_store(filesystem):
        return
    make = os.makedirs if is_local(filesystem) else filesystem.makedirs
    for root, _, _ in os.walk(local_dir):
        relative = os.path.relpath(root, local_dir)
        target = destination if relative == "." else join(destination, relative.replace(os.sep, "/"))
        retry.call(operation, shown_path(filesystem, target), functools.partial(make, target, exist_ok=True))


def upload_with_checksums(
    local_dir: str,
    filesystem: fsspec.AbstractFileSystem,
    destination: str,
    retry: StorageRetry,
    threads: int = MAX_THREADS,
    checksums: bool = True,
    operation: str = OPERATION,
) -> list[FileSum] | None:
    """Copy the files of ``local_dir`` into ``destination`` on ``filesystem`` (merging with what
    is there; each file's copy retried through ``retry``, counted and logged as ``operation``)
    and return each one's ``(relative path, size, checksum)`` as it was read (None without
    ``checksums``, or with them turned off by ``CHECKSUMS_VARIABLE``).

    Raises:
        StorageFullError: no space left for the files.
        StorageUnreachableError: storage kept failing past the retry bound.
        OSError: a copy failed otherwise (the first failure; the other copies are waited for).
    """
    files = files_of(local_dir)
    _make_folders(local_dir, filesystem, destination, retry=retry, operation=operation)
    put = shutil.copy2 if is_local(filesystem) else filesystem.put_file
    needed = functools.partial(folder_size, local_dir)
    checksums = checksums and os.environ.get(CHECKSUMS_VARIABLE, "1") != "0"

    def copy(source: str, relative: str) -> None:
        target = join(destination, relative)
        retry.call(operation, shown_path(filesystem, target), functools.partial(put, source, target), needed)

    with ThreadPoolExecutor(max_workers=max(1, min(threads, 2 * len(files)))) as pool:
        copies = [pool.submit(copy, source, relative) for source, relative in files]
        sums: list[Future[tuple[int, int]]] = [pool.submit(checksum_of_file, s) for s, _ in files if checksums]
        for done in copies:
            done.result()
        if not checksums:
            return None
        return [
            (relative, *checksum.result())
            for (_, relative), checksum in zip(files, sums, strict=True)
            if relative not in UNLISTED
        ]
