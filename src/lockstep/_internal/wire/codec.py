"""Messages as bytes: what :mod:`lockstep._internal.wire.protocol`'s messages look like on the wire.

Every message is JSON, except the one every rank sends at every report (:class:`Report`, unless
it asks for a checkpoint validation or lists the files of a checkpoint it wrote), which has a
fixed binary layout that is an order of magnitude cheaper to read (the driver reads one per
rank per report). Either way, reading a message can build nothing but plain data and the
dataclasses listed in ``protocol.MESSAGE_TYPES``: nothing is ever unpickled here.

The binary report: a ``0x01`` byte, rank and index (signed 64-bit), a flags byte (bit 0: it has
step times), the four step times (64-bit floats), then the four optional strings
(``metrics_json``, ``checkpoint_dir_name``, ``checkpoint_state``, ``external_path``), each a
signed 32-bit length (``-1``: None) and its UTF-8 bytes, and nothing after them. JSON never
starts with that byte.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
from typing import Any

from lockstep._internal.rank.step_timing import StepTimes
from lockstep._internal.wire.protocol import MESSAGE_TYPES, Report

TYPE_KEY = "~type"
BYTES_KEY = "~bytes"
REPORT_MARK = 0x01
_REPORT_HEAD = struct.Struct("!BqqB4d")
_LENGTH = struct.Struct("!i")
_HAS_TIMES = 0x01
_NO_TIMES = (0.0, 0.0, 0.0, 0.0)
_FOUR_NONES = _LENGTH.pack(-1) * 4
_PLAIN_REPORT_SIZE = _REPORT_HEAD.size + len(_FOUR_NONES)


def encode(message: Any) -> bytes:
    """A message as bytes (JSON, or the binary layout of a Report)."""
    if type(message) is Report and message.validation is None and message.files is None:  # (else as JSON)
        return _encode_report(message)
    return json.dumps(_plain(message), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The message that :func:`encode` made.

    Raises:
        ValueError: ``data`` is not such a message.
    """
    if data[:1] == bytes([REPORT_MARK]):
        return _decode_report(data)
    try:
        return json.loads(data, object_hook=_rebuilt)
    except (RecursionError, TypeError) as error:  # nesting too deep; fields a message doesn't have
        raise ValueError(f"not a message: {type(error).__name__}: {error}") from error


def _encode_report(report: Report) -> bytes:
    times = report.step_times
    values = _NO_TIMES if times is None else (times.window_s, times.data_s, times.collective_s, times.report_s)
    parts = [_REPORT_HEAD.pack(REPORT_MARK, report.rank, report.index, 0 if times is None else _HAS_TIMES, *values)]
    for text in (report.metrics_json, report.checkpoint_dir_name, report.checkpoint_state, report.external_path):
        if text is None:
            parts.append(_LENGTH.pack(-1))
        else:
            raw = text.encode()
            parts += [_LENGTH.pack(len(raw)), raw]
    return b"".join(parts)


def _decode_report(data: bytes) -> Report:
    if len(data) == _PLAIN_REPORT_SIZE and data.endswith(_FOUR_NONES):  # a metrics-only report of rank > 0
        _, rank, index, flags, *times = _REPORT_HEAD.unpack_from(data)
        if flags == _HAS_TIMES:
            return Report(rank, index, None, step_times=StepTimes(*times))
    try:
        _, rank, index, flags, *times = _REPORT_HEAD.unpack_from(data)
        offset = _REPORT_HEAD.size
        texts: list[str | None] = []
        for _ in range(4):
            (length,) = _LENGTH.unpack_from(data, offset)
            offset += _LENGTH.size
            if length < 0:
                texts.append(None)
                continue
            if offset + length > len(data):
                raise ValueError("a malformed Report on lockstep's channel: a string runs past its end")
            texts.append(data[offset : offset + length].decode())
            offset += length
    except (struct.error, UnicodeDecodeError) as error:
        raise ValueError(f"a malformed Report on lockstep's channel: {error}") from error
    if offset != len(data) or flags & ~_HAS_TIMES:
        raise ValueError("a malformed Report on lockstep's channel: unexpected bytes")
    step_times = StepTimes(*times) if flags & _HAS_TIMES else None
    metrics_json, dir_name, state, external = texts
    return Report(
        rank=rank,
        index=index,
        metrics_json=metrics_json,
        checkpoint_dir_name=dir_name,
        checkpoint_state=state,
        external_path=external,
        step_times=step_times,
    )


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and type(value).__name__ in MESSAGE_TYPES:
        fields = {item.name: _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
        return {TYPE_KEY: type(value).__name__, **fields}
    if isinstance(value, bytes):
        return {BYTES_KEY: base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a {type(value).__name__} can't travel on lockstep's channel")


def _rebuilt(value: dict[str, Any]) -> Any:
    """One JSON object as the message, bytes or plain dict it stands for (the JSON parser calls
    this for every object, innermost first)."""
    if BYTES_KEY in value:
        try:
            return base64.b64decode(value[BYTES_KEY], validate=True)
        except (TypeError, ValueError) as error:
            raise ValueError(f"malformed bytes on lockstep's channel: {error}") from error
    kind_name = value.pop(TYPE_KEY, None)
    if kind_name is None:
        return value
    kind = MESSAGE_TYPES.get(kind_name) if isinstance(kind_name, str) else None
    if kind is None:
        raise ValueError(f"unknown message type {kind_name!r} on lockstep's channel")
    try:
        return kind(**value)
    except TypeError as error:
        raise ValueError(f"a malformed {kind.__name__} on lockstep's channel: {error}") from error
