"""The checksums of a checkpoint's files in its manifest (manifest.py): XXH3-64 (the ``xxhash``
package), which runs at about 10 GB/s on one core, several times zlib's CRC-32; CRC-32 only to
check manifests written before XXH3 was used (their ``"algorithm"`` says ``"crc32"``).

Files are read in 256 KiB pieces, small enough to stay in the CPU's cache between the read and the
hash (larger pieces measured slower), and never mapped into memory: a file truncated while mapped
would kill the process with SIGBUS instead of failing the check.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Protocol

import xxhash

#: The algorithm of the manifests written now.
ALGORITHM = "xxh3_64"
#: Read size of a checksummed file.
PIECE = 256 << 10


class _Running(Protocol):
    def update(self, data: Any) -> None: ...

    def intdigest(self) -> int: ...


class _Crc32:
    """zlib's CRC-32 with the interface of an ``xxhash`` hasher."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: Any) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def intdigest(self) -> int:
        return self._crc


_HASHERS: dict[str, Callable[[], _Running]] = {"xxh3_64": xxhash.xxh3_64, "crc32": _Crc32}
#: The algorithms a manifest may name.
ALGORITHMS = tuple(_HASHERS)


def shown(value: int, algorithm: str) -> str:
    """A checksum as hexadecimal digits of its algorithm's width."""
    return f"{value:08x}" if algorithm == "crc32" else f"{value:016x}"


def _hasher(algorithm: str) -> _Running:
    try:
        return _HASHERS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})") from None


def checksum_of_stream(handle: Any, algorithm: str = ALGORITHM) -> tuple[int, int]:
    """``(size, checksum)`` of an open binary file on any filesystem, read to its end."""
    hasher, size = _hasher(algorithm), 0
    readinto = getattr(handle, "readinto", None)
    if readinto is None:
        while chunk := handle.read(PIECE):
            hasher.update(chunk)
            size += len(chunk)
        return size, hasher.intdigest()
    view = memoryview(bytearray(PIECE))
    while count := readinto(view):
        hasher.update(view[:count])
        size += count
    return size, hasher.intdigest()


def checksum_of_file(path: str, algorithm: str = ALGORITHM) -> tuple[int, int]:
    """``(size, checksum)`` of a local file."""
    with open(path, "rb", buffering=0) as handle:
        return checksum_of_stream(handle, algorithm)
