"""What a storage error means: worth retrying (transient), the storage is full, or permanent.

The filesystems lockstep writes through raise different things for the same fault:

- s3fs (over aiobotocore) raises botocore's own exceptions for connection faults, which are
  not ``OSError``: ``EndpointConnectionError`` (refused, reset, DNS), ``ConnectTimeoutError``,
  ``ReadTimeoutError``, ``ConnectionClosedError``, ``ResponseStreamingError``; for an answer
  of the server it raises an ``OSError`` translated from the error code (``SlowDown`` and 503 as
  ``EBUSY``, 500 as ``EREMOTEIO``, ``RequestTimeout`` as ``TimeoutError``, ``NoSuchBucket`` as
  ``FileNotFoundError``, ``AccessDenied`` as ``PermissionError``), with botocore's
  ``ClientError`` (and its HTTP status) as its cause.
- pyarrow's S3 filesystem raises a plain ``OSError`` whose message names the AWS error:
  ``AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7, Could not connect``,
  ``AWS Error SLOW_DOWN``, ``AWS Error NO_SUCH_BUCKET``, ``AWS Error ACCESS_DENIED``.
- local disks and NFS raise ``OSError`` with an errno: ``ENOSPC``/``EDQUOT`` (full),
  ``ETIMEDOUT`` & co. (transient on network filesystems), anything else (permanent).

Each error is classified by the first of its chain (the error, its ``__cause__`` and
``__context__``) that says something: a permanent answer wins over a connection fault seen on
the way (s3fs raises ``FileNotFoundError`` from a ``ClientError``). Unknown errors are permanent:
lockstep fails at once, as it did before retrying anything.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterator
from enum import Enum

__all__ = ["FaultKind", "classify"]


class FaultKind(Enum):
    """What to do about a storage error."""

    TRANSIENT = "transient"  # retry: the storage may answer in a moment
    FULL = "full"  # no space left: never retried
    PERMANENT = "permanent"  # fail at once


FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ENETRESET,
        errno.EAGAIN,
        errno.EBUSY,  # s3fs: SlowDown, ServiceUnavailable, 503, 409 OperationAborted
        getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: InternalError, 500
    }
)
#: Exception classes (by name, so that no client library is imported) that are connection or
#: timeout faults: botocore's, aiohttp's, urllib3's, fsspec's.
TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ProxyConnectionError",
        "ClientConnectionError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ClientPayloadError",
        "ProtocolError",
        "FSTimeoutError",
    }
)
#: Error codes of an object store's answer that mean "later" rather than "no".
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "OperationAborted",
    }
)
#: pyarrow's S3 errors, from their messages: ``AWS Error <NAME>`` and HTTP statuses.
PYARROW_TRANSIENT = re.compile(
    r"AWS Error (NETWORK_CONNECTION|SLOW_DOWN|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|THROTTLING|REQUEST_TIMEOUT)"
    r"|HTTP status (5\d\d|429|408)|curlCode: (6|7|28|52|55|56)\b|Connection reset|Connection refused"
    r"|Temporary failure in name resolution|Timeout was reached"
)
PYARROW_PERMANENT = re.compile(r"AWS Error (NO_SUCH_BUCKET|ACCESS_DENIED|NO_SUCH_KEY|INVALID_ACCESS_KEY_ID)")
FULL_MESSAGE = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (28|122)\]")


def classify(error: BaseException) -> FaultKind:
    """What ``error`` (raised by a storage operation) means; see the module's docstring."""
    for link in _chain(error):
        kind = _kind_of(link)
        if kind is not None:
            return kind
    return FaultKind.PERMANENT


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then its causes and contexts (each once)."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def _kind_of(error: BaseException) -> FaultKind | None:
    """What one exception says by itself, or None when it says nothing decisive."""
    if isinstance(error, OSError):
        return _kind_of_os_error(error)
    answer = _http_answer(error)
    if answer is not None:
        return _kind_of_answer(*answer)
    if isinstance(error, TimeoutError) or any(cls.__name__ in TRANSIENT_CLASS_NAMES for cls in type(error).__mro__):
        return FaultKind.TRANSIENT
    return None


def _kind_of_os_error(error: OSError) -> FaultKind | None:
    message = str(error)
    if error.errno in FULL_ERRNOS or FULL_MESSAGE.search(message):
        return FaultKind.FULL
    if isinstance(error, socket.gaierror):
        # a DNS blip; a name that does not exist fails the storage check before the run starts
        return FaultKind.TRANSIENT if error.errno in (socket.EAI_AGAIN, socket.EAI_NONAME) else FaultKind.PERMANENT
    if isinstance(error, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return FaultKind.PERMANENT
    if isinstance(error, (ConnectionError, TimeoutError)) or error.errno in TRANSIENT_ERRNOS:
        return FaultKind.TRANSIENT
    if PYARROW_PERMANENT.search(message):
        return FaultKind.PERMANENT
    if PYARROW_TRANSIENT.search(message):
        return FaultKind.TRANSIENT
    return None


def _http_answer(error: BaseException) -> tuple[str, int] | None:
    """The error code and HTTP status of an object store's answer (botocore's ``ClientError``)."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return str(response["Error"].get("Code", "")), int(status)


def _kind_of_answer(code: str, status: int) -> FaultKind:
    if code in TRANSIENT_CODES or status >= 500 or status in (408, 429):
        return FaultKind.TRANSIENT
    return FaultKind.PERMANENT
