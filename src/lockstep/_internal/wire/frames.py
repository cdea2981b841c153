"""Length-prefixed frames on a byte stream: the channel's framing.

A frame is its length as a 4-byte big-endian signed integer, then its bytes; a frame of 2 GiB or
more has ``-1`` there followed by its length as an 8-byte unsigned integer. This is the framing
of ``multiprocessing.connection.Connection.send_bytes``, so a rank may write its frames with a
``Connection`` while the driver reads many connections at once without blocking: it feeds what
each socket has into that socket's :class:`FrameReader` and takes the whole frames out.
"""

from __future__ import annotations

import struct

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_LONG_MARK = -1
_SHORT_MAX = 0x7FFFFFFF


class FrameTooLarge(ValueError):
    """A frame is longer than its reader allows."""


def frame(payload: bytes) -> bytes:
    """``payload`` as one frame."""
    if len(payload) > _SHORT_MAX:
        return _SHORT.pack(_LONG_MARK) + _LONG.pack(len(payload)) + payload
    return _SHORT.pack(len(payload)) + payload


class FrameReader:
    """The frames of one stream, from its bytes as they come.

    Args:
        max_frame: The longest frame accepted (``None``: no limit); a longer one raises
            :class:`FrameTooLarge` as soon as its length is read.
    """

    def __init__(self, max_frame: int | None = None) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()

    @property
    def pending(self) -> int:
        """Bytes received that are not yet part of a whole frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the frames it completes, in order.

        Raises:
            FrameTooLarge: a frame is longer than ``max_frame``.
            ValueError: a frame's length is negative (not this framing).
        """
        if not self._buffer and len(data) >= _SHORT.size:
            (length,) = _SHORT.unpack_from(data)
            if length == len(data) - _SHORT.size and (self.max_frame is None or length <= self.max_frame):
                return [data[_SHORT.size :]]  # the usual case: exactly one whole frame
        self._buffer += data
        frames: list[bytes] = []
        offset = 0
        while True:
            taken = self._frame_at(offset)
            if taken is None:
                break
            payload, offset = taken
            frames.append(payload)
        if offset:
            del self._buffer[:offset]
        return frames

    def _frame_at(self, offset: int) -> tuple[bytes, int] | None:
        """The whole frame that starts at ``offset`` and where the next one starts, or None."""
        buffer = self._buffer
        if len(buffer) - offset < _SHORT.size:
            return None
        (length,) = _SHORT.unpack_from(buffer, offset)
        start = offset + _SHORT.size
        if length == _LONG_MARK:
            if len(buffer) < start + _LONG.size:
                return None
            (length,) = _LONG.unpack_from(buffer, start)
            start += _LONG.size
        elif length < 0:
            raise ValueError(f"a frame of negative length ({length}): the peer does not speak lockstep's framing")
        if self.max_frame is not None and length > self.max_frame:
            raise FrameTooLarge(f"a frame of {length} bytes, more than the {self.max_frame} allowed here")
        end = start + length
        if len(buffer) < end:
            return None
        return bytes(buffer[start:end]), end
