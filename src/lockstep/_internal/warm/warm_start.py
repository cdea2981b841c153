"""Workers warm before ``fit()``: the driver's side of the warm process.

A driver starts a fresh interpreter in the background (see :mod:`lockstep._internal.warm.zygote`)
that imports torch, lockstep's worker runtime and the installed packages the script imports,
while the driver goes on with its own imports: when ``import lockstep`` first runs in a script
(``python train.py``; :mod:`lockstep._internal.early_warm`), when ``lockstep run train.py``
starts (before the script's first line), or else when :mod:`lockstep.torch` is imported. At
``fit()`` the local executor asks it to import the installed packages the job names, then to fork
one child per rank; the warm process stays for the next ``fit()``. Set ``LOCKSTEP_WARM_START=0``
to start every worker afresh instead.

Nothing is started inside a worker, under torchrun, in a Ray worker, in a process started by
``multiprocessing``, outside the main thread, or off Linux. If the warm process is gone or
refuses, ``fit()`` starts the workers the plain way and logs it once.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from lockstep._internal.descriptors import readable_within
from lockstep._internal.switches import switched_on
from lockstep._internal.warm.preload import preload_modules

logger = logging.getLogger(__name__)

ENV_WARM_START = "LOCKSTEP_WARM_START"
#: What a warm process's environment sets, on one machine and on a Ray node: it starts no warm
#: process of its own, its imports start no thread pools (numpy's OpenBLAS and torch's OpenMP
#: start one per CPU at import, and a process with threads can't fork), and torch asks NVML, not
#: CUDA, whether GPUs are there (CUDA initialised would make forking unsafe too).
WARM_PROCESS_ENV = {
    ENV_WARM_START: "0",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}
PREPARE_TIMEOUT_S = 120.0
FORK_TIMEOUT_S = 30.0
EXIT_CODE_TIMEOUT_S = 5.0
MAX_MESSAGE = 1 << 20

RankProcess = Any  # subprocess.Popen[bytes] or ForkedRank: pid, stdout, stderr, poll(), wait(), returncode
StartRank = Callable[[dict[str, str], int, bool], RankProcess]


class WarmStartUnavailable(RuntimeError):
    """The warm process can't start a rank (gone, refused, or too slow to answer)."""


def enabled() -> bool:
    """Whether the setting allows a warm process (``LOCKSTEP_WARM_START``, on unless 0/false/off)."""
    return switched_on(ENV_WARM_START)


def why_not_here() -> str | None:
    """Why this process must not start a warm process, or None when it may."""
    from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS, launched_by_launcher

    if not enabled():
        return f"{ENV_WARM_START}=0"
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return "not Linux (needs pidfd_open)"
    if ENV_DRIVER_ADDRESS in os.environ:
        return "this is one of lockstep's workers"
    if launched_by_launcher():
        return "started by torchrun"
    if _in_ray_worker():
        return "this is a Ray worker"
    import multiprocessing

    if multiprocessing.parent_process() is not None or "--multiprocessing-fork" in sys.orig_argv:
        return "started by multiprocessing"  # the flag: a spawned child still importing the main script
    if threading.current_thread() is not threading.main_thread():
        return "not the main thread (the warm process would die with this thread)"
    return None


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        worker = ray._private.worker  # private: hence the broad fallback
        return bool(worker.global_worker.mode == worker.WORKER_MODE)
    except Exception:  # noqa: BLE001
        return False


class WarmProcess:
    """The driver's handle on its warm process: requests go over a socket pair."""

    def __init__(self, guessed: list[str]) -> None:
        from lockstep._internal.rank.python_path import worker_pythonpath

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env.update(WARM_PROCESS_ENV, PYTHONUNBUFFERED="1", PYTHONPATH=worker_pythonpath(env))
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lockstep._internal.warm.zygote",
                str(theirs.fileno()),
                str(os.getpid()),
                json.dumps(guessed),
            ],
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.owner = os.getpid()
        self.pid = self.process.pid
        self._socket = ours
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._prepared = False
        self.used = False

    def alive(self) -> bool:
        """Whether the process still runs and belongs to this process (not to a fork of it)."""
        return os.getpid() == self.owner and self.process.poll() is None

    def prepare(self, payload: bytes) -> None:
        """Send the import path and have the installed packages the job names imported."""
        modules = preload_modules(payload)
        reply, _ = self._request(
            {"op": "prepare", "sys_path": _absolute(sys.path), "modules": modules}, [], PREPARE_TIMEOUT_S
        )
        if reply.get("skipped"):
            logger.debug("the warm process could not import %s; the workers import them", reply["skipped"])

    def fork(self, env: dict[str, str], stdout: int, stderr: int, payload_fd: int) -> tuple[int, int]:
        """Fork a rank: its pid and a pidfd for it."""
        request = {"op": "fork", "env": env, "cwd": os.getcwd()}
        reply, fds = self._request(request, [stdout, stderr, payload_fd], FORK_TIMEOUT_S)
        if len(fds) != 1:
            raise WarmStartUnavailable(f"the warm process sent {len(fds)} handles for a new rank, not 1")
        self.used = True
        return int(reply["pid"]), fds[0]

    def exit_code(self, pid: int) -> int | None:
        """A child's exit code as Popen reports it, once the warm process has reaped it."""
        deadline = time.monotonic() + EXIT_CODE_TIMEOUT_S
        with self._lock:
            while pid not in self._exits:
                try:
                    self._receive(deadline)
                except WarmStartUnavailable:
                    return None
            return self._exits.pop(pid)

    def _request(self, message: dict[str, Any], fds: list[int], timeout: float) -> tuple[dict[str, Any], list[int]]:
        data = json.dumps(message).encode()
        with self._lock:
            try:
                socket.send_fds(self._socket, [data], fds) if fds else self._socket.send(data)
            except OSError as error:
                raise WarmStartUnavailable(f"can't reach it ({error})") from error
            deadline = time.monotonic() + timeout
            while True:
                reply, received = self._receive(deadline)
                if reply is not None:
                    break
        if not reply.get("ok"):
            raise WarmStartUnavailable(f"it refused: {reply.get('error')}")
        return reply, received

    def _receive(self, deadline: float) -> tuple[dict[str, Any] | None, list[int]]:
        """One message: a reply (returned), or an exit notice (recorded; None returned)."""
        if not readable_within(self._socket, max(0.0, deadline - time.monotonic())):
            raise WarmStartUnavailable("it did not answer in time")
        try:
            data, fds, _, _ = socket.recv_fds(self._socket, MAX_MESSAGE, 4)
        except OSError as error:
            raise WarmStartUnavailable(f"its socket failed ({error})") from error
        if not data:
            raise WarmStartUnavailable(f"it exited (code {self.process.poll()})")
        message = json.loads(data)
        if "exited" in message:
            self._exits[int(message["exited"])] = int(message["code"])
            return None, []
        return message, fds

    def close(self) -> None:
        """Stop the warm process (its children die with it) and reap it."""
        self._socket.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class ForkedRank:
    """A rank forked by the warm process, with what local.py uses of a ``Popen``."""

    def __init__(
        self, warm: WarmProcess, pid: int, pidfd: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None
    ) -> None:
        self.pid, self.pidfd, self.stdout, self.stderr = pid, pidfd, stdout, stderr
        self.returncode: int | None = None
        self._warm = warm

    def poll(self) -> int | None:
        """The exit code if the rank has ended, else None."""
        if self.returncode is None and readable_within(self.pidfd, 0):
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the rank to end; its exit code."""
        if self.returncode is None:
            if not readable_within(self.pidfd, timeout):
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def _collect(self) -> None:
        code = self._warm.exit_code(self.pid)
        self.returncode = -signal.SIGKILL if code is None else code  # no warm process: killed with it
        os.close(self.pidfd)


# -- the process-wide warm process ------------------------------------------------------------

_warm: WarmProcess | None = None
_fallback_logged = False
_released = False


def start_in_background(guessed: Sequence[str] = ()) -> None:
    """Start the warm process, unless one runs or this process must not have one; it also
    imports the installed modules of ``guessed`` (those the user's script imports) until the
    first ``fit()``."""
    global _warm
    if _warm is not None:
        return
    reason = why_not_here()
    if reason is not None:
        logger.debug("no warm process: %s", reason)
        return
    try:
        _warm = WarmProcess(list(guessed))
    except OSError as error:
        logger.debug("no warm process: %s", error)
        return
    atexit.register(shutdown)


def warm_process_pid() -> int | None:
    """The pid of this process's warm process, or None (for tests and diagnostics)."""
    return _warm.pid if _warm is not None and _warm.owner == os.getpid() else None


def shutdown() -> None:
    """Stop this process's warm process, if any (at exit; also when no fit will use it)."""
    global _warm
    if _warm is not None and _warm.owner == os.getpid():
        _warm.close()
    _warm = None


def release_unused(why: str) -> None:
    """Stop the warm process if no ``fit()`` has used it yet: this driver's runs go elsewhere
    (``why``: Ray), and an idle warm process holds hundreds of MiB. A later local ``fit()``
    then starts its workers the plain way and a warm process again for the fits after it."""
    global _released
    if _warm is not None and _warm.owner == os.getpid() and not _warm.used:
        logger.debug("stopping the unused warm process: %s", why)
        shutdown()
        _released = True


def rank_starter(payload: bytes, plain: StartRank) -> StartRank:
    """How this ``fit()`` starts a rank: ``start(env, payload_fd, piped)``. Forked by the warm
    process when there is one (first told what to import), else (or once it fails) ``plain``."""
    global _released
    warm = _warm
    if warm is None and _released and enabled():
        _released = False
        start_in_background()  # for the next fit: a local one came after all
        return plain
    if warm is None or warm.owner != os.getpid():
        return plain
    if not enabled():  # turned off after the import
        shutdown()
        return plain
    try:
        if not warm.alive():
            raise WarmStartUnavailable(f"it exited (code {warm.process.returncode})")
        warm.prepare(payload)
    except WarmStartUnavailable as error:
        _give_up(error)
        return plain

    def start(env: dict[str, str], payload_fd: int, piped: bool) -> RankProcess:
        if _warm is not warm:
            return plain(env, payload_fd, piped)
        try:
            return _fork_rank(warm, env, payload_fd, piped)
        except WarmStartUnavailable as error:
            _give_up(error)
            return plain(env, payload_fd, piped)

    return start


def _fork_rank(warm: WarmProcess, env: dict[str, str], payload_fd: int, piped: bool) -> ForkedRank:
    if not piped:
        pid, pidfd = warm.fork(env, 1, 2, payload_fd)
        return ForkedRank(warm=warm, pid=pid, pidfd=pidfd, stdout=None, stderr=None)
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        pid, pidfd = warm.fork(env, out_write, err_write, payload_fd)
    except BaseException:
        os.close(out_read)
        os.close(err_read)
        raise
    finally:
        os.close(out_write)
        os.close(err_write)
    return ForkedRank(
        warm=warm,
        pid=pid,
        pidfd=pidfd,
        stdout=open(out_read, "rb", buffering=0),
        stderr=open(err_read, "rb", buffering=0),
    )


def exit_handle(process: RankProcess) -> int:
    """A pidfd that becomes readable when ``process`` ends (the caller closes it)."""
    if isinstance(process, ForkedRank):
        return os.dup(process.pidfd)
    return os.pidfd_open(process.pid)


def _give_up(error: WarmStartUnavailable) -> None:
    """Stop using the warm process for the rest of this process; say so once."""
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        logger.warning(
            "the warm worker process can't be used (%s); starting workers the plain way (set %s=0 to skip it)",
            error,
            ENV_WARM_START,
        )
    shutdown()


def _absolute(path: list[str]) -> list[str]:
    return [os.path.abspath(entry or os.getcwd()) for entry in path]
