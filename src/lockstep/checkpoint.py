"""Checkpoint: a folder of files, on local disk or remote storage, that a run reported."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import fsspec

from lockstep._internal.persist import filesystems, manifest
from lockstep.errors import CheckpointCorruptedError

__all__ = ["Checkpoint"]


METADATA_FILE = ".metadata.json"


class Checkpoint:
    """A folder of checkpoint files on some filesystem.

    Create one from a local folder inside the train function and pass it to
    :func:`lockstep.report`; read one back from ``Result.checkpoint``.

    Example:
        >>> with tempfile.TemporaryDirectory() as tmp:                    # doctest: +SKIP
        ...     torch.save(model.state_dict(), os.path.join(tmp, "model.pt"))
        ...     lockstep.report({"loss": 0.1}, checkpoint=Checkpoint.from_directory(tmp))
        >>> with result.checkpoint.as_directory() as folder:              # doctest: +SKIP
        ...     state = torch.load(os.path.join(folder, "model.pt"))

    Args:
        path: The folder, a local path or a URI such as ``s3://bucket/run/checkpoint_000001``.
        filesystem: The fsspec filesystem holding ``path`` (inferred from the path when None).
    """

    def __init__(self, path: str | os.PathLike[str], filesystem: fsspec.AbstractFileSystem | None = None) -> None:
        self.filesystem, self.path = filesystems.resolve_filesystem(path, filesystem)
        self._expects_manifest = False

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """A checkpoint for an existing local folder.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            NotADirectoryError: ``path`` is a file, not a folder.
        """
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Checkpoint.from_directory: {path!r} does not exist; write your checkpoint files "
                "into a folder first (e.g. a tempfile.TemporaryDirectory()) and pass that folder."
            )
        if not os.path.isdir(path):
            raise NotADirectoryError(
                f"Checkpoint.from_directory: {path!r} is a file; pass the folder that contains it."
            )
        return cls(path)

    @property
    def uri(self) -> str:
        """The folder as a path (local) or a URI such as ``s3://…`` (remote)."""
        return self.path if self.is_local else self.filesystem.unstrip_protocol(self.path)

    @property
    def is_local(self) -> bool:
        """Whether the files are on this machine's disk."""
        return filesystems.is_local(self.filesystem)

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copy the checkpoint's files into a local folder and return that folder.

        The copy is checked against the manifest the run wrote when it committed the checkpoint
        (every file's size and checksum); a checkpoint without one (written by an older lockstep,
        or registered with NO_UPLOAD) is copied as it is, with a warning.

        Args:
            path: Destination folder (created if missing); a new temporary folder when None.

        Raises:
            CheckpointCorruptedError: a file is missing, or its size or checksum differs from
                the manifest; the message names each such file.
        """
        destination = os.fspath(path) if path is not None else filesystems.make_temp_dir("lockstep_checkpoint_")
        os.makedirs(destination, exist_ok=True)
        try:
            filesystems.download_directory(self.filesystem, self.path, destination)
            self._verify(destination)
        except BaseException:
            if path is None:  # a folder of ours that nobody will get to remove
                shutil.rmtree(destination, ignore_errors=True)
            raise
        return destination

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """The checkpoint as a local folder for the duration of a ``with`` block.

        A local checkpoint is yielded in place (don't modify it); a remote one is downloaded
        to a temporary folder that is removed when the block exits. Either way the files are
        first checked against the checkpoint's manifest, as :meth:`to_directory` says.

        Raises:
            CheckpointCorruptedError: a file is missing, or its size or checksum differs from
                the manifest written when the checkpoint was committed.
        """
        if self.is_local:
            self._verify(self.path)
            yield self.path
            return
        local = self.to_directory()
        try:
            yield local
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def _committed(self) -> Checkpoint:
        """Mark this checkpoint as one a run committed: loading it without a manifest warns."""
        self._expects_manifest = True
        return self

    def _verify(self, local_copy: str) -> None:
        """Check the local folder ``local_copy`` of this checkpoint against its manifest."""
        document = manifest.read_manifest(self.filesystem, self.path)
        if document is None:
            if getattr(self, "_expects_manifest", False):
                manifest.warn_unverifiable(self.uri)
            return
        problems = manifest.verify_local(local_copy, document)
        if problems:
            raise CheckpointCorruptedError(self.uri, problems)

    def get_metadata(self) -> dict[str, Any]:
        """The metadata dict stored in the checkpoint (``{}`` when none)."""
        metadata_path = filesystems.join(self.path, METADATA_FILE)
        if not self.filesystem.exists(metadata_path):
            return {}
        with self.filesystem.open(metadata_path, "r", encoding="utf-8") as handle:
            return json.load(handle)

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Replace the checkpoint's metadata (must be JSON-serializable)."""
        data = json.dumps(metadata)
        self.filesystem.makedirs(self.path, exist_ok=True)
        with self.filesystem.open(filesystems.join(self.path, METADATA_FILE), "w", encoding="utf-8") as handle:
            handle.write(data)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        """Merge ``metadata`` into the checkpoint's metadata."""
        self.set_metadata({**self.get_metadata(), **metadata})

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.uri!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Checkpoint):
            return NotImplemented
        return self.path == other.path and type(self.filesystem) is type(other.filesystem)

    def __hash__(self) -> int:
        return hash((self.path, type(self.filesystem).__name__))
