"""CRC-32 (zlib's) of files, on several threads: a file is cut into 8 MiB blocks whose CRCs are
computed at the same time (``zlib.crc32`` lets go of the GIL) and folded into the CRC of the whole
file, the same number ``zlib.crc32(whole_file)`` gives.

Folding: appending a block of n bytes changes a CRC linearly, ``crc(a + b) = M_n(crc(a)) ^ crc(b)``
(zlib's ``crc32_combine``), where ``M_n`` is a 32x32 bit matrix kept as the images of the 32 bits.
Only ``M`` for the block size is needed: the short block, if any, comes first (``M_n(0)`` is 0).
"""

from __future__ import annotations

import functools
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

BLOCK = 8 << 20
#: Threads that checksum one file (at most); 1 on a one-CPU machine.
THREADS = max(1, min(4, os.cpu_count() or 1))


def _apply(matrix: tuple[int, ...], crc: int) -> int:
    result, bit = 0, 0
    while crc:
        if crc & 1:
            result ^= matrix[bit]
        crc >>= 1
        bit += 1
    return result


@functools.cache
def _appending(length: int) -> tuple[int, ...]:
    """``M_length``: the linear change of a CRC when ``length`` bytes are appended, found by
    squaring the one for a single byte (``length`` is a power of two)."""
    if length == 1:
        zero = zlib.crc32(b"\0", 0)
        return tuple(zlib.crc32(b"\0", 1 << bit) ^ zero for bit in range(32))
    half = _appending(length // 2)
    return tuple(_apply(half, column) for column in half)


def combine(crc: int, next_crc: int) -> int:
    """The CRC of ``a + b`` from ``crc`` (of ``a``) and ``next_crc`` (of ``b``, a whole block)."""
    return _apply(_appending(BLOCK), crc) ^ next_crc


def _crc_of_range(path: str, start: int, length: int) -> tuple[int, int]:
    crc = read = 0
    buffer = bytearray(min(length, BLOCK) or 1)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start)
        while read < length and (count := handle.readinto(view[: length - read])):
            crc = zlib.crc32(view[:count], crc)
            read += count
    return read, crc


def crc32_of_file(path: str, threads: int | None = None) -> tuple[int, int]:
    """``(size, CRC-32)`` of a local file, its 8 MiB blocks checksummed on up to ``threads``
    threads (default :data:`THREADS`)."""
    threads = THREADS if threads is None else threads
    size = os.path.getsize(path)
    head = size % BLOCK
    ranges = ([(0, head)] if head else []) + [(start, BLOCK) for start in range(head, size, BLOCK)]
    if threads <= 1 or len(ranges) <= 1:
        read, crc = _crc_of_range(path, 0, size)
        return read, crc
    with ThreadPoolExecutor(max_workers=min(threads, len(ranges))) as pool:
        parts = list(pool.map(lambda item: _crc_of_range(path, *item), ranges))
    crc = parts[0][1]
    for read, part in parts[1:]:
        if read != BLOCK:  # the file changed while it was read: checksum it again, in one go
            return _crc_of_range(path, 0, os.path.getsize(path))
        crc = combine(crc, part)
    return sum(read for read, _ in parts), crc


def crc32_of_stream(handle: Any) -> tuple[int, int]:
    """``(size, CRC-32)`` of an open binary file on any filesystem."""
    crc = size = 0
    while chunk := handle.read(BLOCK):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return size, crc
