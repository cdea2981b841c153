"""Ranks forked on their Ray node: one warm process per node imports torch once, and each rank's
actor asks it for a fork instead of importing torch (and ``torch._dynamo``) in its own process.

On a node of a Ray cluster every rank's actor is a fresh Python that pays for the same imports
(2.4 CPU-s before the train function, 1.7 more in ``prepare_model`` on this project's 2-CPU
machine: see docs/scaling.md). Instead, the actor of the node's first rank
starts lockstep's warm process (:mod:`lockstep._internal.warm.zygote`) as its child, listening on
a Unix socket of the node (an abstract name: nothing on disk), and every rank's actor on the node
connects to it and has it fork the rank. The forked process is the rank: it connects to the
driver, runs the train function and sends its output over its channel; its actor waits for its
exit and returns its code, as when the actor runs the rank itself. It dies with its actor (the
warm process kills a connection's children when the connection closes) and with the warm
process, which dies with the first rank's actor.

The forked rank is not a Ray worker: it can't call Ray (``ray.get``, Ray Data). The executor
forks ranks unless ``LOCKSTEP_RAY_FORK=0``, the run gives the ranks GPUs or Ray Datasets, or the
train function names Ray (:mod:`lockstep._internal.executors.ray_forking`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

from lockstep._internal.rank.forwarded_output import ENV_FORWARD_OUTPUT
from lockstep._internal.rank.stack_buffer import dump_size, new_stack_buffer, read_dump
from lockstep._internal.rank.whereabouts import dump_without_plumbing, with_source_lines
from lockstep._internal.switches import switched_on
from lockstep._internal.warm.warm_handle import WARM_PROCESS_ENV

__all__ = ["ENV_RAY_FORK", "ForkRefused", "ForkedRank", "NodeForker", "WarmProcessGone", "fork_requested"]

#: Set to 0 (false, off, no): ranks on Ray run in their actors, never forked.
ENV_RAY_FORK = "LOCKSTEP_RAY_FORK"
#: How long a rank's actor waits for the warm process to answer a fork request (its imports
#: come first: torch and torch._dynamo take seconds on a busy node).
FORK_ANSWER_TIMEOUT_S = 300.0
STACK_DUMP_WAIT_S = 2.0
STACK_DUMP_POLL_S = 0.05
MAX_MESSAGE = 1 << 16


class WarmProcessGone(RuntimeError):
    """The node's warm process refused a fork or ended."""


class ForkRefused(WarmProcessGone):
    """The node's warm process answered a fork request with a refusal: no rank process exists."""


def fork_requested() -> bool:
    """Whether ``LOCKSTEP_RAY_FORK`` allows forked ranks (on unless 0, false, off or no)."""
    return switched_on(ENV_RAY_FORK)


def node_socket_name() -> str:
    """A fresh abstract socket name (two raylets on one host share the namespace)."""
    return f"lockstep-ray-fork-{os.getpid()}-{uuid.uuid4().hex}"


class NodeForker:
    """The warm process of this node, a child of this actor (it dies with it), importing
    torch, lockstep's worker runtime and ``modules``, then serving fork requests on the socket
    :attr:`name`."""

    def __init__(self, modules: list[str]) -> None:
        self.name = node_socket_name()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind("\0" + self.name)
        listener.listen(socket.SOMAXCONN)
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, **WARM_PROCESS_ENV)
        command = [sys.executable, "-m", "lockstep._internal.warm.zygote", str(theirs.fileno()), str(os.getpid())]
        command += [json.dumps(modules), str(listener.fileno())]
        try:
            self.process = subprocess.Popen(
                command, pass_fds=(theirs.fileno(), listener.fileno()), env=env, stdin=subprocess.DEVNULL
            )
        finally:
            theirs.close()
            listener.close()

    def alive(self) -> bool:
        """Whether the warm process still runs."""
        return self.process.poll() is None

    def close(self) -> None:
        """End the warm process (its children die with it)."""
        self.control.close()
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()


class ForkedRank:
    """One rank, forked by the warm process of this node at this actor's request: ``env`` is
    the rank's whole environment, ``path_first`` the driver's import path entries found here."""

    def __init__(self, socket_name: str, payload: bytes, env: dict[str, str], path_first: list[str]) -> None:
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._stacks = new_stack_buffer()
        try:
            self._connection.connect("\0" + socket_name)
            answer = self._ask_for_fork(payload, env, path_first)
        except BaseException:
            self.close()  # a rank forked later for this connection is killed as it closes
            raise
        if not answer.get("ok"):
            self.close()
            raise ForkRefused(f"the node's warm process refused to fork the rank: {answer.get('error')}")
        self.pid = int(answer["pid"])

    def _ask_for_fork(self, payload: bytes, env: dict[str, str], path_first: list[str]) -> dict[str, Any]:
        """Send the fork request (the payload in a memfd, the actor's stdout and stderr, the stack
        buffer); the warm process's answer."""
        payload_fd = os.memfd_create("lockstep-payload")
        try:
            _write_all(payload_fd, payload)
            request = {
                "op": "fork",
                "env": {**env, ENV_FORWARD_OUTPUT: "1"},
                "cwd": os.getcwd(),
                "path_first": path_first,
            }
            socket.send_fds(self._connection, [json.dumps(request).encode()], [1, 2, payload_fd, self._stacks])
        finally:
            os.close(payload_fd)
        answer, fds = self._receive(FORK_ANSWER_TIMEOUT_S)
        for handle in fds:
            os.close(handle)
        return answer

    def wait(self) -> int:
        """The rank's exit code once it ends (negative: the signal that killed it)."""
        try:
            while True:
                message, fds = self._receive(None)
                for handle in fds:
                    os.close(handle)
                if message.get("exited") == self.pid:
                    return int(message["code"])
        finally:
            self.close()

    def stack(self) -> str:
        """The rank's Python stacks (faulthandler's dump on SIGUSR1, lockstep's frames left out,
        source lines added), once the dump has stopped growing (up to :data:`STACK_DUMP_WAIT_S`)."""
        seen = ""
        try:  # the rank may end meanwhile, and its end closes the buffer (another thread's wait())
            start = dump_size(self._stacks)
            os.kill(self.pid, signal.SIGUSR1)
            deadline = time.monotonic() + STACK_DUMP_WAIT_S
            while time.monotonic() < deadline:
                time.sleep(STACK_DUMP_POLL_S)
                text = read_dump(self._stacks, start)
                if text and text == seen:
                    break
                seen = text
        except OSError:  # ProcessLookupError among them: the rank has ended
            return ""
        return with_source_lines(dump_without_plumbing(seen))

    def close(self) -> None:
        """Let go of the connection (the warm process then kills the rank if it still runs)."""
        self._connection.close()
        stacks, self._stacks = self._stacks, -1
        if stacks >= 0:
            os.close(stacks)

    def _receive(self, timeout: float | None) -> tuple[dict[str, Any], list[int]]:
        self._connection.settimeout(timeout)
        try:
            data, fds, _, _ = socket.recv_fds(self._connection, MAX_MESSAGE, 4)
        except TimeoutError as error:
            raise WarmProcessGone(f"the node's warm process did not answer within {timeout:g} s") from error
        except OSError as error:
            raise WarmProcessGone(f"the node's warm process is gone ({error})") from error
        if not data:
            raise WarmProcessGone("the node's warm process ended (see the Ray worker logs of the node)")
        return json.loads(data), fds


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
