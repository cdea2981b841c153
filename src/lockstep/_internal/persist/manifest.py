"""The manifest of a committed checkpoint: every file's relative path, size and checksum, so that
a truncated upload, a lost file or flipped bytes are found when the checkpoint is loaded, not
when ``torch.load`` fails.

Each rank checksums its files while copying them into storage (transfer.py) and sends the list
to the driver with its report; the driver writes the merged manifest just before the run record
names the checkpoint (a checkpoint the record names therefore always has one, unless it was
written by an older lockstep or registered where it was, NO_UPLOAD). Ranks that write the same
file name with different contents leave one of them in the folder, which one is not known, so
the manifest lists every version written and a file matching any of them is whole.

The manifest lives beside the checkpoint folder, not in it, so that listing a checkpoint shows
the user's files only: ``<run>/.lockstep_manifests/checkpoint_000003.json`` for
``<run>/checkpoint_000003``::

    {"format": 1, "algorithm": "xxh3_64",
     "files": {"model.pt": [{"size": 46830571, "xxh3_64": 11620883403364733271, "ranks": [0]}], ...}}

The checksum is the one named by ``"algorithm"`` (checksums.py), under that name in each version;
manifests written before XXH3 was used say ``"crc32"`` and are checked with it.

``.metadata.json`` (``Checkpoint.set_metadata``, which may change after the commit) is not
listed; files added to the folder later are not checked.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from lockstep._internal.persist.checksums import ALGORITHM, ALGORITHMS, checksum_of_file, checksum_of_stream, shown
from lockstep._internal.persist.filesystems import default_retry, is_local, is_object_store, join, shown_path
from lockstep.errors import CheckpointCorruptedError

logger = logging.getLogger(__name__)

#: The folder of manifests, in the folder that holds the checkpoints (the run folder).
MANIFEST_DIR = ".lockstep_manifests"
METADATA_FILE = ".metadata.json"
#: Files of a checkpoint folder that no manifest lists.
UNLISTED = frozenset({METADATA_FILE})
FORMAT = 1

#: One file a rank wrote: (relative path with '/', size in bytes, checksum by checksums.ALGORITHM).
FileSum = tuple[str, int, int]


def manifest_path(checkpoint_path: str) -> str:
    """Where the manifest of the checkpoint folder ``checkpoint_path`` is."""
    parent, _, name = checkpoint_path.rstrip("/").rpartition("/")
    return join(parent or "/", MANIFEST_DIR, f"{name}.json")


# -- writing (the driver, at the commit) ----------------------------------------------------------


def merged(files_by_rank: Mapping[int, Iterable[Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every rank's file list as the manifest's ``files``: per path, each distinct version."""
    files: dict[str, list[dict[str, Any]]] = {}
    for rank in sorted(files_by_rank):
        for path, size, checksum in files_by_rank[rank]:
            versions = files.setdefault(path, [])
            same = next((v for v in versions if v["size"] == size and v[ALGORITHM] == checksum), None)
            if same is None:
                versions.append({"size": size, ALGORITHM: checksum, "ranks": [rank]})
            else:
                same["ranks"].append(rank)
    return dict(sorted(files.items()))


def write_manifest(
    filesystem: fsspec.AbstractFileSystem, folder: str, files_by_rank: Mapping[int, Iterable[Any]]
) -> None:
    """Write the manifest of the checkpoint in ``folder`` (one small file, one PUT)."""
    document = {"format": FORMAT, "algorithm": ALGORITHM, "files": merged(files_by_rank)}
    data = json.dumps(document, separators=(",", ":")).encode()
    target = manifest_path(folder)
    if is_local(filesystem):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(data)
        return
    if not is_object_store(filesystem):
        filesystem.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    filesystem.pipe_file(target, data)


def delete_manifest(filesystem: fsspec.AbstractFileSystem, folder: str) -> None:
    """Remove the manifest of the checkpoint in ``folder``, if it has one."""
    with contextlib.suppress(FileNotFoundError):
        filesystem.rm_file(manifest_path(folder))


def read_manifest(filesystem: fsspec.AbstractFileSystem, folder: str) -> dict[str, Any] | None:
    """The manifest of the checkpoint in ``folder`` (None when it has none).

    Raises:
        CheckpointCorruptedError: the manifest itself is not readable JSON.
    """
    if "/" not in folder.strip("/"):  # a bucket or the root: never a committed checkpoint
        return None
    target = manifest_path(folder)
    try:
        read = functools.partial(filesystem.cat_file, target)
        data = default_retry().call("download_checkpoint", shown_path(filesystem, target), read)
    except FileNotFoundError:
        return None
    try:
        document = json.loads(data)
        if not isinstance(document.get("files"), dict):
            raise ValueError("no 'files' table")
        document.setdefault("algorithm", "crc32")
        if document["algorithm"] not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {document['algorithm']!r}")
    except ValueError as error:
        raise CheckpointCorruptedError(folder, [f"its manifest {target} is unreadable ({error})"]) from error
    return document


# -- checking ------------------------------------------------------------------------------------


def problem_of(
    path: str, versions: list[dict[str, Any]], found: tuple[int, int] | None, algorithm: str = ALGORITHM
) -> str | None:
    """What is wrong with one file, given its ``(size, checksum)`` (None: missing); None if whole."""
    writers = sorted({rank for version in versions for rank in version.get("ranks", [])})
    by = f" (written by rank {', '.join(map(str, writers))})" if writers else ""
    if found is None:
        return f"{path}: missing{by}"
    size, checksum = found
    if not any(version["size"] == size for version in versions):
        expected = " or ".join(str(version["size"]) for version in versions)
        return f"{path}: {size} bytes, {expected} when committed{by}"
    if not any(version["size"] == size and version[algorithm] == checksum for version in versions):
        committed = shown(versions[0][algorithm], algorithm)
        return f"{path}: checksum differs ({algorithm} {shown(checksum, algorithm)}, {committed} when committed){by}"
    return None


def verify_local(folder: str, manifest: dict[str, Any], threads: int = 4) -> list[str]:
    """The damaged files of a local checkpoint folder (empty when every listed file is whole)."""
    algorithm = manifest["algorithm"]

    def check(item: tuple[str, list[dict[str, Any]]]) -> str | None:
        path, versions = item
        local = os.path.join(folder, *path.split("/"))
        try:
            size = os.path.getsize(local)
        except OSError:
            return problem_of(path, versions, None, algorithm)
        if not any(version["size"] == size for version in versions):
            return problem_of(path, versions, (size, 0), algorithm)
        return problem_of(path, versions, checksum_of_file(local, algorithm), algorithm)

    items = list(manifest["files"].items())
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(items)))) as pool:
        return [problem for problem in pool.map(check, items) if problem is not None]


def verify_remote(filesystem: fsspec.AbstractFileSystem, folder: str, manifest: dict[str, Any]) -> list[str]:
    """The damaged files of a checkpoint folder on any filesystem, read as a stream."""
    filesystem.invalidate_cache()  # listings cached by this process may predate the files' last writes
    sizes = {
        entry["name"][len(folder.rstrip("/")) + 1 :]: entry.get("size")
        for entry in filesystem.find(folder, detail=True).values()
    }
    problems = []
    for path, versions in manifest["files"].items():
        size = sizes.get(path)
        if size is None:
            found = None
        elif not any(version["size"] == size for version in versions):
            found = (size, 0)
        else:
            with filesystem.open(join(folder, path), "rb", block_size=8 << 20) as handle:
                found = checksum_of_stream(handle, manifest["algorithm"])
        problem = problem_of(path, versions, found, manifest["algorithm"])
        if problem is not None:
            problems.append(problem)
    return problems


def verify_folder(filesystem: fsspec.AbstractFileSystem, folder: str) -> list[str] | None:
    """The damaged files of the checkpoint in ``folder`` on ``filesystem``; None when it has no manifest."""
    manifest = read_manifest(filesystem, folder)
    if manifest is None:
        return None
    if is_local(filesystem):
        return verify_local(folder, manifest)
    return verify_remote(filesystem, folder, manifest)


_warned_unverifiable: set[str] = set()


def warn_unverifiable(uri: str) -> None:
    """Say once per checkpoint and process that a checkpoint has no manifest to check it by."""
    if uri in _warned_unverifiable:
        return
    _warned_unverifiable.add(uri)
    logger.warning(
        "checkpoint %s has no manifest (written by an older lockstep, or registered where it was with "
        "NO_UPLOAD): its files can't be verified; loading them as they are.",
        uri,
    )
