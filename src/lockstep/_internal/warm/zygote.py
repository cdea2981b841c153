"""The warm process: ``python -m lockstep._internal.warm.zygote CONTROL_FD DRIVER_PID [GUESSED [LISTEN_FD]]``.

A fresh interpreter (never a fork of the user's driver) that imports torch and lockstep's worker
runtime, then the installed modules of ``GUESSED`` (a JSON list: what the driver's script imports,
see :func:`lockstep._internal.warm.preload.guessed_modules`) until the driver's first request
arrives, then waits for the driver (see :mod:`lockstep._internal.warm.warm_start`). At ``fit()`` the
driver asks it to import the modules the job names and to fork one child per rank; each child
becomes what ``python -m lockstep._internal.rank.worker`` would be: the driver's environment and
working directory at ``fit()``, a session of its own, the driver's output pipes and payload file
(passed over the control socket), and death with this process, which dies with the driver.

Messages are JSON, one per SOCK_SEQPACKET datagram, descriptors attached with SCM_RIGHTS:

- ``{"op": "prepare", "sys_path": [...], "modules": [...]}`` → ``{"ok": true, "skipped": [...]}``
- ``{"op": "fork", "env": {...}, "cwd": "..."}`` + [stdout, stderr, payload] →
  ``{"ok": true, "pid": N}`` + [pidfd of the child]
- unprompted, when a child ends: ``{"exited": pid, "code": returncode}`` (as Popen reports it)
- any refusal: ``{"ok": false, "error": "..."}``; after one the process exits.

With ``LISTEN_FD`` (a listening Unix socket, SOCK_SEQPACKET: on a Ray node, see
:mod:`lockstep._internal.ray_compat.ray_fork`) it also serves every connection made to that socket
as it serves the driver's: fork requests, each answered on its own connection, with the child's
exit told there too. A connection's children are killed when it closes (the rank's Ray actor
is gone); the guessed imports are all made before the first connection is served. A connection
from a process of another user is closed at once (SO_PEERCRED).

Forking is refused when this process is no longer safe to fork: a thread running (a preloaded
module started one, guessed or asked for), or CUDA initialised or its driver library loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any

PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 1 << 20
MAX_FDS = 8


def die_with(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def warm_up() -> None:
    """Import what every rank imports (torch, the worker runtime, the torch backend)."""
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import lockstep._internal.payload  # noqa: F401
    import lockstep._internal.rank.worker  # noqa: F401
    import lockstep._internal.rank.worker_session  # noqa: F401
    import lockstep.context  # noqa: F401
    import lockstep.data  # noqa: F401
    import lockstep.torch  # noqa: F401  (LOCKSTEP_WARM_START=0 here: starts nothing)


def import_guessed(names: list[str], control: socket.socket) -> str | None:
    """Import the installed modules of ``names`` in order, until the driver sends a request
    (its ``fit()`` has come: what it needs is then asked for exactly). Returns why forking became
    unsafe (a module started a thread, ...), or None."""
    poller = select.poll()
    poller.register(control.fileno(), select.POLLIN)
    for name in names:
        if poller.poll(0):
            break
        if name in sys.modules or not _installed(name.partition(".")[0]):
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a guess: the workers import what they need themselves
            continue
        reason = unsafe_to_fork()
        if reason is not None:
            return f"after importing {name!r} (imported by the script), {reason}"
    return None


def _installed(top: str) -> bool:
    """Whether the top-level module ``top`` comes from this Python's installation (found
    without importing it): never the user's own files."""
    from lockstep._internal.installed import installed_file

    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    places = [spec.origin] if spec is not None and spec.origin else []
    if spec is not None and spec.submodule_search_locations:
        places += list(spec.submodule_search_locations)
    return bool(places) and all(installed_file(place) for place in places)


def os_threads() -> int:
    """This process's threads, as the kernel counts them (Python's and native ones)."""
    return len(os.listdir("/proc/self/task"))


def unsafe_to_fork() -> str | None:
    """Why forking now would give the children a broken state, or None when it is safe."""
    if threading.active_count() > 1 or os_threads() > 1:
        return f"{os_threads()} threads are running in it (a fork copies only one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised in it"
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        if "libcuda.so" in maps.read():
            return "the CUDA driver library was loaded in it"
    return None


class Zygote:
    """Serves the driver's requests on ``control`` until the driver closes it, and those of
    the connections made to ``listener`` (if any)."""

    def __init__(
        self, control: socket.socket, unsafe: str | None = None, listener: socket.socket | None = None
    ) -> None:
        self.control = control
        self.unsafe = unsafe  # why forking is unsafe since the guessed imports, refused at once
        self.listener = listener
        self.clients: set[socket.socket] = set()
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the connection that asked)
        self.base_path = _base_path()

    def serve(self) -> None:
        """Answer requests and report children's exits, until the driver's end of stream."""
        while True:
            for handle in self._ready():
                if self.listener is not None and handle is self.listener:
                    self._accept(self.listener)
                elif isinstance(handle, socket.socket):
                    if not self._answer(handle):
                        if handle is self.control:
                            return
                        self._drop(handle)
                else:
                    self._reap(handle)

    def _ready(self) -> list[Any]:
        """The sockets and the children's pidfds that are readable (waits for one). ``poll``,
        not ``select``: a pidfd may be numbered past 1024."""
        sockets = [self.control, *([self.listener] if self.listener is not None else []), *self.clients]
        watched: dict[int, Any] = {each.fileno(): each for each in sockets}
        watched.update({pidfd: pidfd for pidfd in self.children})
        poller = select.poll()
        for descriptor in watched:
            poller.register(descriptor, select.POLLIN)
        return [watched[descriptor] for descriptor, _ in poller.poll()]

    def _send(self, to: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode()
        if fds:
            socket.send_fds(to, [data], fds)
        else:
            to.send(data)

    def _answer(self, asker: socket.socket) -> bool:
        """Answer one request from ``asker``; False at its end of stream or after a refusal."""
        try:
            data, fds, _, _ = socket.recv_fds(asker, MAX_MESSAGE, MAX_FDS)
        except OSError:  # a connection reset: its end
            return False
        try:
            if not data:  # its end of stream (descriptors sent with an empty message are closed below)
                return False
            request = json.loads(data)
            if self.unsafe is not None:
                raise RuntimeError(f"the warm process can't fork safely: {self.unsafe}")
            if request["op"] == "prepare":
                self._send(asker, {"ok": True, "skipped": self._prepare(request["sys_path"], request["modules"])})
            elif request["op"] == "fork":
                self._fork(asker, request, fds)
            else:
                raise ValueError(f"unknown request {request['op']!r}")
        except Exception as error:  # noqa: BLE001 - any failure is told to the asker, then we stop
            with contextlib.suppress(OSError):
                self._send(asker, {"ok": False, "error": f"{type(error).__name__}: {error}"})
            return False
        finally:
            for handle in fds:
                os.close(handle)
        return True

    def _accept(self, listener: socket.socket) -> None:
        """Take a connection from a process of this process's user only: a fork request runs
        the code it names, and an abstract socket is open to every user of the host."""
        try:
            client, _ = listener.accept()
        except OSError:
            return
        _, uid, _ = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():
            client.close()
            return
        self.clients.add(client)

    def _drop(self, client: socket.socket) -> None:
        """A connection ended: kill the children it asked for (they are reaped as usual)."""
        self.clients.discard(client)
        client.close()
        for pid, asker in self.children.values():
            if asker is client:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _prepare(self, sys_path: list[str], modules: list[str]) -> list[str]:
        """Import ``modules`` with the driver's import path; return those that failed."""
        sys.path[:] = sys_path
        importlib.invalidate_caches()
        skipped = []
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - the child imports it itself when it unpickles
                skipped.append(name)
            reason = unsafe_to_fork()
            if reason is not None:
                raise RuntimeError(f"after importing {name!r}, {reason}")
        return skipped

    def _fork(self, asker: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        if len(fds) != 4:
            raise ValueError(f"a fork request needs 4 descriptors (stdout, stderr, payload, stacks), got {len(fds)}")
        reason = unsafe_to_fork()
        if reason is not None:
            raise RuntimeError(f"the warm process can't fork safely: {reason}")
        zygote_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            become_worker(request, fds, zygote_pid, self)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, asker)
        self._send(asker, {"ok": True, "pid": pid}, [pidfd])

    def _reap(self, pidfd: int) -> None:
        pid, asker = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):  # the asker may be gone (a dropped connection)
            self._send(asker, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def close_in_child(self) -> None:
        """Let go of the driver's socket, the listener, the connections and the siblings'
        handles (in a forked child)."""
        for each in [self.control, *([self.listener] if self.listener is not None else []), *self.clients]:
            each.close()
        self.clients.clear()
        for pidfd in self.children:
            os.close(pidfd)
        self.children.clear()


def _base_path() -> list[str]:
    """The import path a fresh interpreter has without a script folder or PYTHONPATH (the
    standard library, site-packages and what their .pth files add)."""
    from_env = {os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry}
    return [entry for entry in sys.path[1:] if os.path.abspath(entry) not in from_env]


def child_path(env: dict[str, str], cwd: str, base: list[str], first: list[str] | None = None) -> list[str]:
    """The import path ``python -m`` would give a worker started in ``cwd`` with ``env``, after
    the entries ``first`` (the driver's own, for a rank on Ray)."""
    from_env = [os.path.abspath(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return list(dict.fromkeys([*(first or []), cwd, *from_env, *base]))


def become_worker(request: dict[str, Any], fds: list[int], zygote_pid: int, zygote: Zygote) -> None:
    """In the forked child: take on the worker's environment, streams and payload, then run
    the worker's main. Never returns."""
    try:
        die_with(zygote_pid)
        os.setsid()
        zygote.close_in_child()
        stdout, stderr, payload, stacks = fds
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        from lockstep._internal.rank import worker
        from lockstep._internal.rank.stack_buffer import ENV_STACK_FD

        env = dict(request["env"], **{worker.ENV_PAYLOAD_FD: str(payload), ENV_STACK_FD: str(stacks)})
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        sys.path[:] = child_path(env, request["cwd"], zygote.base_path, request.get("path_first"))
        importlib.invalidate_caches()
        sys.argv = [worker.__file__]
        _reseed_numpy()
        worker.main(forked_by=zygote_pid)
    except BaseException:  # noqa: BLE001 - report on the rank's stderr, never return to the loop
        traceback.print_exc()
    finally:
        os._exit(1)


def _reseed_numpy() -> None:
    """numpy's global generator was seeded once, in this process's parent: draw a fresh seed,
    as a new interpreter would (Python's ``random`` reseeds itself after a fork)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def main() -> None:
    """Warm up, then serve the driver that started this process (and, with a listening
    socket, whoever connects to it)."""
    control_fd, driver_pid = int(sys.argv[1]), int(sys.argv[2])
    die_with(driver_pid)
    control = socket.socket(fileno=control_fd)
    listener = socket.socket(fileno=int(sys.argv[4])) if len(sys.argv) > 4 else None
    warm_up()
    guessed = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
    Zygote(control, import_guessed(guessed, control), listener).serve()
    os._exit(0)  # the driver has gone: the children die with this process


if __name__ == "__main__":
    main()
