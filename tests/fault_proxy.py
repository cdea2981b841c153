"""A fault-injecting TCP proxy on 127.0.0.1, put in front of the S3 test server
(tests/s3_server.py) to make storage misbehave the way a real object store does.

Faults, asked for by the test or, during a run, by a rank through the control port:

- an outage: for N seconds every connection is refused (the listening socket is closed, so a
  connect gets ECONNREFUSED, as from a server that is down), and the connections open when it
  begins are reset;
- after it, every k-th new connection is reset (RST) when the server's first answer on it comes
  back: the request reached the server, the client never hears how it went, as when a load
  balancer drops a connection;
- throttling: while ``slow_down`` is set, every request is answered ``503 Slow Down`` with S3's
  error body, by the proxy (the server never sees it).

Example::

    with FaultProxy(upstream_port) as proxy:
        env["AWS_ENDPOINT_URL"] = proxy.url
        ...                                  # a rank: start_outage(proxy.control_port, 15, 5)
        assert proxy.outages                 # (start, end) wall times of each outage
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from types import TracebackType

CHUNK = 65536
SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def start_outage(control_port: int, seconds: float, reset_every: int) -> None:
    """Ask the proxy behind ``control_port`` for an outage of ``seconds``, then a reset of every
    ``reset_every``-th connection (0: none); returns once the outage has begun."""
    with socket.create_connection(("127.0.0.1", control_port), timeout=10) as control:
        control.sendall(f"outage {seconds} {reset_every}\n".encode())
        assert control.makefile().readline().strip() == "ok", "the proxy did not start the outage"


def _reset(connection: socket.socket) -> None:
    """Close ``connection`` with a RST instead of a FIN (the peer reads ECONNRESET)."""
    with contextlib.suppress(OSError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # wakes a thread blocked reading it (a close alone would not, and no RST would go out
        # until that read returned); shutting down reading sends nothing
        connection.shutdown(socket.SHUT_RD)
    connection.close()


def _listen(port: int = 0) -> socket.socket:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    return listener


class _Link:
    """One proxied connection: the client's socket and the server's, copied both ways."""

    def __init__(self, client: socket.socket, upstream: socket.socket, doomed: bool) -> None:
        self.client, self.upstream, self.doomed = client, upstream, doomed
        self._closed = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._pump, args=(self.client, self.upstream, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.upstream, self.client, True), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, from_server: bool) -> None:
        try:
            while data := source.recv(CHUNK):
                if from_server and self.doomed:
                    self.reset()
                    return
                target.sendall(data)
        except OSError:
            pass
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed.locked()

    def reset(self) -> None:
        """Drop the connection: a RST to the client."""
        if self._closed.acquire(blocking=False):
            _reset(self.client)
            with contextlib.suppress(OSError):
                self.upstream.shutdown(socket.SHUT_RDWR)
            self.upstream.close()

    def close(self) -> None:
        if self._closed.acquire(blocking=False):
            for side in (self.client, self.upstream):
                with contextlib.suppress(OSError):
                    side.shutdown(socket.SHUT_RDWR)
                side.close()


class FaultProxy:
    """The proxy (see the module's docstring): ``url`` to reach the server through it,
    ``control_port`` for :func:`start_outage`; ``outages`` holds the (start, end) wall times of
    the outages so far (end None while one lasts), ``resets`` the connections reset after them."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._lock = threading.Condition()
        self._listener: socket.socket | None = _listen()
        self.port = self._listener.getsockname()[1]
        self._control = _listen()
        self.control_port = self._control.getsockname()[1]
        self._links: list[_Link] = []
        self._closed = False
        self.connections = 0
        self.reset_every = 0
        self.resets = 0
        self.slow_down = False
        self.outages: list[tuple[float, float | None]] = []

    @property
    def url(self) -> str:
        """The endpoint URL that reaches the server through the proxy."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        threading.Thread(target=self._serve, name="fault-proxy", daemon=True).start()
        threading.Thread(target=self._serve_control, name="fault-proxy-control", daemon=True).start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            links, self._links = self._links, []
            self._lock.notify_all()
        for sock in (listener, self._control):
            if sock is not None:
                self._stop_listening(sock)
        for link in links:
            link.close()

    # -- faults ---------------------------------------------------------------------------------

    def outage(self, seconds: float, reset_every: int = 0) -> None:
        """Refuse every connection for ``seconds`` (resetting those open now), then reset every
        ``reset_every``-th new connection. Returns once the refusing has begun."""
        with self._lock:
            listener, self._listener = self._listener, None
            links, self._links = self._links, []
            self.outages.append((time.time(), None))
        if listener is not None:
            self._stop_listening(listener)
        for link in links:
            link.reset()
        timer = threading.Timer(seconds, self._end_outage, args=(reset_every,))
        timer.daemon = True
        timer.start()

    def _end_outage(self, reset_every: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._listener = _listen(self.port)
            self.reset_every = reset_every
            self.connections = 0
            self.outages[-1] = (self.outages[-1][0], time.time())
            self._lock.notify_all()

    # -- serving --------------------------------------------------------------------------------

    @staticmethod
    def _stop_listening(listener: socket.socket) -> None:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        listener.close()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while self._listener is None and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                listener = self._listener
            try:
                client, _ = listener.accept()
            except OSError:
                continue  # closed for an outage, or for good
            self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        if self.slow_down:
            threading.Thread(target=self._answer_slow_down, args=(client,), daemon=True).start()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            _reset(client)
            return
        with self._lock:
            self.connections += 1
            doomed = self.reset_every > 0 and self.connections % self.reset_every == 0
            self.resets += doomed
            link = _Link(client, upstream, doomed)
            self._links = [*(known for known in self._links if not known.closed), link]
        link.start()

    @staticmethod
    def _answer_slow_down(client: socket.socket) -> None:
        with client, contextlib.suppress(OSError):
            request = b""
            while b"\r\n\r\n" not in request and (data := client.recv(CHUNK)):
                request += data
            client.sendall(SLOW_DOWN % (len(SLOW_DOWN_BODY), SLOW_DOWN_BODY))

    def _serve_control(self) -> None:
        while True:
            try:
                connection, _ = self._control.accept()
            except OSError:
                return
            with connection:
                command = connection.makefile().readline().split()
                if command and command[0] == "outage":
                    self.outage(float(command[1]), int(command[2]))
                    connection.sendall(b"ok\n")
