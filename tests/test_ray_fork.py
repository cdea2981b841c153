"""A Ray node's warm process (lockstep._internal.ray_compat.ray_fork) without Ray: the ranks it
forks for each connection are its children, a rank's end is told to the connection that asked
for it, and a connection that closes (its actor is gone) takes its ranks with it. The whole path
on a Ray cluster is in test_ray.py (test_forked_ranks_are_children_of_one_warm_process_per_node
and the tests run both ways)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import parent_of, running_after

from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS
from lockstep._internal.ray_compat.ray_fork import ForkedRank, ForkRefused, NodeForker
from lockstep._internal.wire.channel import ENV_AUTHKEY, ENV_DRIVER_PID


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended and been reaped by its parent within 20 s."""
    return not running_after({pid}, 20)


@pytest.fixture
def silent_driver() -> Iterator[socket.socket]:
    """A TCP listener that accepts ranks and never answers their hello: a rank waits there."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server


@pytest.fixture
def forker() -> Iterator[NodeForker]:
    warm = NodeForker([])
    try:
        yield warm
    finally:
        warm.close()


def rank_env(driver: socket.socket) -> dict[str, str]:
    port = driver.getsockname()[1]
    return {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        ENV_DRIVER_ADDRESS: f"127.0.0.1:{port}",
        ENV_AUTHKEY: "00" * 32,
        ENV_DRIVER_PID: str(os.getpid()),
    }


@pytest.mark.timeout(120)
def test_a_rank_is_a_child_of_the_warm_process_and_its_end_is_told_to_its_asker(
    forker: NodeForker, silent_driver: socket.socket
) -> None:
    rank = ForkedRank(forker.name, b"not read before the driver answers", rank_env(silent_driver), [])
    try:
        accepted, _ = silent_driver.accept()  # the rank has connected and waits for the challenge
        assert parent_of(rank.pid) == forker.process.pid
        accepted.close()  # the "driver" refuses it: the rank fails and exits
        assert rank.wait() == 1
    finally:
        rank.close()
    assert gone(rank.pid)


@pytest.mark.timeout(120)
def test_a_closed_connection_takes_its_ranks_with_it(forker: NodeForker, silent_driver: socket.socket) -> None:
    kept = ForkedRank(forker.name, b"", rank_env(silent_driver), [])
    dropped = ForkedRank(forker.name, b"", rank_env(silent_driver), [])
    accepted = [silent_driver.accept()[0] for _ in range(2)]  # kept open: the ranks wait on them
    try:
        dropped.close()  # as when its Ray actor is killed
        assert gone(dropped.pid), "a rank outlived the connection that asked for it"
        assert Path(f"/proc/{kept.pid}").exists(), "another connection's rank was killed too"
    finally:
        kept.close()
        for connection in accepted:
            connection.close()
    assert gone(kept.pid)
    assert forker.alive()  # connections come and go; the warm process stays for the next ranks


@pytest.mark.timeout(120)
def test_the_ranks_die_with_the_warm_process(forker: NodeForker, silent_driver: socket.socket) -> None:
    rank = ForkedRank(forker.name, b"", rank_env(silent_driver), [])
    accepted, _ = silent_driver.accept()
    try:
        forker.close()  # as when the node's first actor is killed
        assert gone(rank.pid)
    finally:
        rank.close()
        accepted.close()


def ask_as(uid: int, socket_name: str) -> str:
    """From a child process running as ``uid``: send the warm process a fork request without
    descriptors; what came back ("answer ..." or "refused ...")."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls from here on, then _exit
        outcome = "refused nothing"
        try:
            os.setuid(uid)
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            connection.connect("\0" + socket_name)
            connection.settimeout(20)
            connection.send(json.dumps({"op": "fork", "env": {}, "cwd": "/"}).encode())
            outcome = f"answer {connection.recv(1 << 16)!r}"
        except OSError as error:
            outcome = f"refused {type(error).__name__}"
        finally:
            os.write(write_end, outcome.encode())
            os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as result:
            return result.read().decode()
    finally:
        os.waitpid(pid, 0)


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user (CI runs as root)")
def test_another_user_s_connection_is_closed_unanswered(forker: NodeForker) -> None:
    own = ask_as(os.getuid(), forker.name)
    assert own.startswith("answer ") and "needs 4 descriptors" in own  # this user's request is read
    other = ask_as(65534, forker.name)
    assert other in ("answer b''", "refused ConnectionResetError", "refused BrokenPipeError"), other
    assert forker.alive()


@pytest.mark.timeout(60)
def test_a_refused_fork_is_told_apart_and_leaves_nothing() -> None:
    """A refusal (the actor then runs the rank itself) is a ForkRefused; nothing of the request
    stays (its stack buffer, its connection), and nothing of it was ever a file in a folder."""
    name = f"lockstep-test-refusing-{os.getpid()}"
    sent: list[str] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind("\0" + name)
        listener.listen()

        def refuse() -> None:
            connection, _ = listener.accept()
            with connection:
                _, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
                for handle in fds:
                    sent.append(os.readlink(f"/proc/self/fd/{handle}"))
                    os.close(handle)
                connection.send(json.dumps({"ok": False, "error": "RuntimeError: can't fork safely"}).encode())

        refuser = threading.Thread(target=refuse, daemon=True)
        refuser.start()
        buffers_before = open_stack_buffers()
        with pytest.raises(ForkRefused, match="can't fork safely"):
            ForkedRank(name, b"", {}, [])
        refuser.join(10)
    assert len(sent) == 4 and sent[3].startswith("/memfd:lockstep-stacks"), sent
    assert open_stack_buffers() == buffers_before


def open_stack_buffers() -> set[int]:
    """This process's open descriptors of ranks' stack buffers (in-memory files)."""
    found = set()
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed while listed
            if os.readlink(f"/proc/self/fd/{entry}").startswith("/memfd:lockstep-stacks"):
                found.add(int(entry))
    return found
