"""Network faults across two hosts (see tests/hosts.py): host B is cut off mid-run (its
interface goes down: no reset, no end of stream, its processes live on) or its processes are
all killed at once (a lost machine). The run must end within a bound, naming the lost rank,
never hang; with ``max_failures`` and an elastic size it goes on with what remains; and once
host B is back, running the same command again continues from the latest checkpoint.

The bound: a channel whose other end doesn't answer is given up after 20 s (TCP keepalive and
user timeout), and a rank stuck in a collective after that ends its process 10 s later (see
``lockstep._internal.wire.link_watch``): the README's ~30 s. The tests allow that figure plus a 15 s
margin (process start-up and teardown under load on 2 CPUs), :data:`FAULT_BOUND_S`, for the run
to end, and check what the error says: the rank, that it is lost, and its host's address.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from hosts import Host, HostNetwork, RayCluster, kill_tree, torchrun_commands

from lockstep._internal.wire.link_watch import (
    LINK_TIMEOUT_S,
    STUCK_GRACE_S,
    StalledSends,
    send_queue_state,
    watch_link,
)

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "two_host_fault_job.py")
README_BOUND_S = LINK_TIMEOUT_S + STUCK_GRACE_S
FAULT_BOUND_S = README_BOUND_S + 15
RUN_TIMEOUT_S = 150
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def test_a_send_queue_waiting_without_any_acknowledgement_is_a_lost_link() -> None:
    """A rank's progress thread may leave data in the send queue when the network is cut, which
    stops keepalive probes: the watch then goes by the send queue and the acknowledgements."""
    rule = StalledSends(timeout_s=20)
    assert not rule.lost(48, 300.0, now=0.0), "just sent on a long-idle connection: one round trip, not a loss"
    assert not rule.lost(0, 0.0, now=0.5)
    assert not rule.lost(79, 2.0, now=10.0)  # the cut: data waits from here on, nothing comes back
    assert not rule.lost(79, 21.0, now=29.0)
    assert rule.lost(79, 22.5, now=30.5)
    reader_stopped = StalledSends(timeout_s=20)  # a driver that stops reading: its kernel answers the probes
    assert not any(reader_stopped.lost(65536, 0.4, now=float(second)) for second in range(120))


def test_the_send_queue_is_read_off_a_real_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
        try:
            assert send_queue_state(sender) == (0, pytest.approx(0.0, abs=1.0))
            sender.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:  # the receiver never reads: its window closes and the queue fills
                    sender.send(b"x" * 65536)
            queued, since_ack_s = send_queue_state(sender)
            assert queued > 0 and since_ack_s < 5.0
        finally:
            sender.close()
            receiver.close()


def test_connections_that_fall_silent_together_probe_at_different_moments() -> None:
    """At 1,024 ranks the channels fell silent at the same moment and their keepalive probes,
    sent at once, overflowed the kernel's backlog of received packets: the same connections lost
    their probes again and again and were given up as lost hosts. Each connection now draws its
    own probe timing, and each gives up after about LINK_TIMEOUT_S."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(64)]
        try:
            for client in clients:
                watch_link(client, sends_little=True)
            timings = [
                tuple(
                    client.getsockopt(socket.IPPROTO_TCP, option)
                    for option in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)
                )
                for client in clients
            ]
            assert len({idle for idle, _, _ in timings}) >= 4, timings
            assert all(abs(idle + interval * probes - LINK_TIMEOUT_S) <= 3 for idle, interval, probes in timings)
            assert all(
                client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == LINK_TIMEOUT_S * 1000
                for client in clients
            )
        finally:
            for client in clients:
                client.close()


@pytest.fixture
def ray_cluster(two_hosts: HostNetwork) -> Iterator[RayCluster]:
    """Ray head on host A with two CPUs, a worker node on host B with one; its own for each
    test (the tests take nodes away). Two workers spread over both hosts; both fit on A alone."""
    host_a, host_b = two_hosts.hosts
    cluster = RayCluster(host_a, [host_b], cpus=1, head_cpus=2)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def start(host: Host, args: list[str]) -> subprocess.Popen[bytes]:
    return host.popen(args, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT)


def finish(process: subprocess.Popen[bytes], timeout: float) -> tuple[int | None, str]:
    """Wait up to ``timeout`` s for ``process``; its exit code (None: it had to be killed) and output."""
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output.decode(errors="replace")
    except subprocess.TimeoutExpired:
        kill_tree(process)
        return None, process.communicate()[0].decode(errors="replace")


def committed_step(run_path: Path) -> int | None:
    """The step in the run's latest committed checkpoint, or None (no record or checkpoint yet)."""
    from lockstep import Result

    try:
        checkpoint = Result.from_path(str(run_path)).checkpoint
        return None if checkpoint is None else int(Path(checkpoint.path, "step.txt").read_text())
    except (FileNotFoundError, ValueError, OSError):
        return None


def wait_for_step(run_path: Path, step: int, processes: list[subprocess.Popen[bytes]], timeout: float = 120) -> None:
    """Wait until the run has committed a checkpoint of ``step`` or later."""
    deadline = time.monotonic() + timeout
    while (committed_step(run_path) or -1) < step:
        ended = [process.args for process in processes if process.poll() is not None]
        if ended or time.monotonic() > deadline:
            outputs = "\n---\n".join(finish(process, 1)[1][-3000:] for process in processes)
            pytest.fail(
                f"the run did not reach step {step} ({'ended: ' + str(ended) if ended else 'timed out'}):\n{outputs}"
            )
        time.sleep(0.2)


def result_line(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line:\n{output[-5000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


def assert_continues_from(result: dict, step: int, last_step: int) -> None:
    """The rerun went on from the checkpoint of ``step`` to ``last_step`` without a failure (the
    history holds the earlier run's reports too)."""
    rerun = [row[0] for row in result["history"] if row[2] == step]
    assert rerun == list(range(step + 1, last_step + 1)), result["history"]
    assert result["checkpoint_step"] == last_step and result["error"] is None


def assert_names_lost_rank(output: str, host_b: Host) -> None:
    """The run's error names rank 1 as lost, and its host by address, in one failure."""
    lost = f"rank 1: WorkerDied: lost: its host {host_b.address} has not answered for {LINK_TIMEOUT_S:g} s"
    assert lost in output, output[-5000:]


def assert_names_dead_rank(output: str, host_b: Host) -> None:
    """The run's error names rank 1, whose processes were killed, and its host by address."""
    dead = f"rank 1: WorkerDied: its process closed its channel to rank 0: it exited or crashed (host {host_b.address})"
    assert dead in output, output[-5000:]


def ended_within_bound(started: float, what: str) -> None:
    took = time.monotonic() - started
    print(f"{what} ended {took:.1f} s after the fault")
    assert took <= FAULT_BOUND_S, f"{what} took {took:.1f} s to end, more than {FAULT_BOUND_S:g} s"


# -- Ray ------------------------------------------------------------------------------------------


def ray_job(cluster: RayCluster, storage: Path, *options: str) -> subprocess.Popen[bytes]:
    return start(cluster.head, [sys.executable, SCRIPT, str(storage), "--ray", cluster.address, *options])


@pytest.mark.timeout(RUN_TIMEOUT_S + 2 * FAULT_BOUND_S)
def test_ray_run_whose_host_b_is_cut_off_fails_naming_it_and_continues_once_it_is_back(
    two_hosts: HostNetwork, ray_cluster: RayCluster, tmp_path: Path
) -> None:
    host_b = ray_cluster.workers[0]
    driver = ray_job(ray_cluster, tmp_path, "--steps", "1000")
    wait_for_step(tmp_path / "faults", 2, [driver])
    two_hosts.cut(host_b)
    cut_at = time.monotonic()
    code, output = finish(driver, FAULT_BOUND_S)
    assert code == 1 and "FAILED" in output, f"the run must fail, not hang:\n{output[-5000:]}"
    ended_within_bound(cut_at, "the driver")
    assert_names_lost_rank(output, host_b)
    step = committed_step(tmp_path / "faults")
    assert step is not None and step >= 2
    two_hosts.restore(host_b)
    ray_cluster.restart(host_b)  # Ray marked the cut-off node dead: it does not come back by itself
    code, output = finish(ray_job(ray_cluster, tmp_path, "--steps", str(step + 3)), RUN_TIMEOUT_S)
    assert code == 0, f"the rerun failed:\n{output[-5000:]}\n{ray_cluster.logs()}"
    assert_continues_from(result_line(output), step, step + 2)


@pytest.mark.timeout(RUN_TIMEOUT_S + FAULT_BOUND_S)
def test_ray_run_whose_host_b_dies_goes_on_with_what_remains(ray_cluster: RayCluster, tmp_path: Path) -> None:
    host_b = ray_cluster.workers[0]
    driver = ray_job(ray_cluster, tmp_path, "--steps", "24", "--max-failures", "1")
    wait_for_step(tmp_path / "faults", 2, [driver])
    host_b.kill_all()  # the machine is gone: its Ray node and its rank at once
    code, output = finish(driver, RUN_TIMEOUT_S)
    assert code == 0, f"the run must restart on host A alone:\n{output[-5000:]}"
    result = result_line(output)
    assert result["num_failures"] == 1
    restarted = [row for row in result["history"] if row[2] is not None]
    assert restarted and restarted[0][0] == restarted[0][2] + 1, result["history"]
    assert result["history"][-1][0] == 23, "the run must reach its last step"


# -- torchrun -------------------------------------------------------------------------------------


def torchruns(network: HostNetwork, storage: Path, steps: int) -> list[subprocess.Popen[bytes]]:
    commands = torchrun_commands(network.hosts, SCRIPT, str(storage), "--steps", str(steps))
    return [start(host, command) for host, command in commands]


def rerun_continues(network: HostNetwork, storage: Path) -> None:
    """Both hosts run the job again: it continues from the latest committed checkpoint."""
    step = committed_step(storage / "faults")
    assert step is not None and step >= 2
    outcomes = [finish(process, RUN_TIMEOUT_S) for process in torchruns(network, storage, step + 3)]
    assert [code for code, _ in outcomes] == [0, 0], "\n---\n".join(output[-4000:] for _, output in outcomes)
    assert_continues_from(result_line(outcomes[0][1]), step, step + 2)


@pytest.mark.timeout(RUN_TIMEOUT_S + 2 * FAULT_BOUND_S)
def test_torchrun_ranks_end_when_host_b_is_cut_off_and_the_rerun_continues(
    two_hosts: HostNetwork, tmp_path: Path
) -> None:
    host_a, host_b = two_hosts.hosts
    processes = torchruns(two_hosts, tmp_path, 1000)
    try:
        wait_for_step(tmp_path / "faults", 2, processes)
        two_hosts.cut(host_b)
        cut_at = time.monotonic()
        (code_a, output_a), (code_b, output_b) = [finish(process, FAULT_BOUND_S) for process in processes]
    finally:
        two_hosts.restore(host_b)
        for process in processes:
            kill_tree(process)
    assert code_a not in (0, None), f"host A's torchrun must fail, not hang:\n{output_a[-5000:]}"
    assert code_b not in (0, None), f"host B's torchrun must end, not hang:\n{output_b[-5000:]}"
    ended_within_bound(cut_at, "both torchruns")
    assert_names_lost_rank(output_a, host_b)
    assert code_b not in (0, None), f"host B's torchrun must end, not hang:\n{output_b[-5000:]}"
    assert "channel to the driver" in output_b, output_b[-5000:]
    rerun_continues(two_hosts, tmp_path)


@pytest.mark.timeout(RUN_TIMEOUT_S + FAULT_BOUND_S)
def test_torchrun_rank_0_fails_when_host_b_dies_and_the_rerun_continues(two_hosts: HostNetwork, tmp_path: Path) -> None:
    host_b = two_hosts.hosts[1]
    processes = torchruns(two_hosts, tmp_path, 1000)
    try:
        wait_for_step(tmp_path / "faults", 2, processes)
        host_b.kill_all()
        killed_at = time.monotonic()
        code_a, output_a = finish(processes[0], FAULT_BOUND_S)
    finally:
        for process in processes:
            kill_tree(process)
    assert code_a not in (0, None), f"host A's torchrun must fail, not hang:\n{output_a[-5000:]}"
    ended_within_bound(killed_at, "host A's torchrun")
    assert_names_dead_rank(output_a, host_b)
    rerun_continues(two_hosts, tmp_path)
