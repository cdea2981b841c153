"""The driver's handle on its warm process (:mod:`lockstep._internal.warm.zygote`): requests over a
socket pair, and the ranks it forks, used by the local executor like ``Popen`` objects.
When and whether a driver has a warm process is :mod:`lockstep._internal.warm.warm_start`'s."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, NamedTuple

from lockstep._internal.descriptors import readable_within
from lockstep._internal.warm.preload import preload_modules

logger = logging.getLogger(__name__)

__all__ = [
    "ENV_WARM_START",
    "WARM_PROCESS_ENV",
    "ForkedRank",
    "RankFiles",
    "RankProcess",
    "StartRank",
    "WarmProcess",
    "WarmStartUnavailable",
    "exit_handle",
    "fork_rank",
]

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


class RankFiles(NamedTuple):
    """The descriptors a rank inherits besides its output: its job's payload and its stack buffer
    (:mod:`lockstep._internal.rank.stack_buffer`)."""

    payload: int
    stacks: int


#: How a ``fit()`` starts a rank: ``start(env, files, piped)``, its output piped when ``piped``.
StartRank = Callable[[dict[str, str], RankFiles, bool], RankProcess]


class WarmStartUnavailable(RuntimeError):
    """The warm process can't start a rank (gone, refused, or too slow to answer)."""


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

    def fork(self, env: dict[str, str], stdout: int, stderr: int, files: RankFiles) -> tuple[int, int]:
        """Fork a rank: its pid and a pidfd for it."""
        request = {"op": "fork", "env": env, "cwd": os.getcwd()}
        reply, fds = self._request(request, [stdout, stderr, *files], FORK_TIMEOUT_S)
        if len(fds) != 1:
            for handle in fds:
                os.close(handle)
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
            for handle in received:
                os.close(handle)
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


def fork_rank(warm: WarmProcess, env: dict[str, str], files: RankFiles, piped: bool) -> ForkedRank:
    """Have ``warm`` fork a rank with ``files``, its output piped when ``piped`` (else this process's)."""
    if not piped:
        pid, pidfd = warm.fork(env, 1, 2, files)
        return ForkedRank(warm=warm, pid=pid, pidfd=pidfd, stdout=None, stderr=None)
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        pid, pidfd = warm.fork(env, out_write, err_write, files)
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


def _absolute(path: list[str]) -> list[str]:
    return [os.path.abspath(entry or os.getcwd()) for entry in path]
