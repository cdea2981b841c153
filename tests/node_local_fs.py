"""A filesystem that gives each "node" its own disk, to test what happens when storage_path is
not shared: the driver and rank 0 see one folder, other ranks (as if on another machine)
see another. On a test Ray cluster, a raylet started with LOCKSTEP_TEST_NODE=<n> in its
environment is node <n>."""

from __future__ import annotations

import os

from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem


class NodeLocalFileSystem(DirFileSystem):
    """Paths resolve under ``<root>/node-0`` in the driver and rank 0, and under
    ``<root>/node-<rank>`` in the other ranks (``<root>/node-<LOCKSTEP_TEST_NODE>`` when set)."""

    def __init__(self, root: str, **kwargs: object) -> None:
        self.root = root
        super().__init__(path=root, fs=LocalFileSystem(), **kwargs)

    @property  # type: ignore[override]
    def path(self) -> str:
        node = os.environ.get("LOCKSTEP_TEST_NODE", os.environ.get("RANK", "0"))
        return os.path.join(self.root, f"node-{node}")

    @path.setter
    def path(self, value: str) -> None:
        pass

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.root,))
