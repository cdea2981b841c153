"""Runs across two hosts for real: two network namespaces, each with its own address, while the
machine's hostname resolves to loopback on both (see tests/hosts.py).

- A Ray cluster (head on host A, a worker node on host B, the driver on host A): two workers
  spread over both hosts all-reduce across them and both write checkpoint files; storage that
  host B can't see is refused with the "must be shared" message before any checkpoint.
- ``torchrun --nnodes=2`` on the two hosts (static rendezvous at host A's address).

Without lockstep's interface choice (GLOO_SOCKET_IFNAME), gloo advertises the address the
hostname resolves to (loopback here) and these runs fail to connect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from hosts import Host, HostNetwork, RayCluster, free_port, kill_tree, wait_listening

SCRIPTS = REPO_ROOT / "tests" / "scripts"
RUN_TIMEOUT_S = 150


def run_on(hosts: Sequence[tuple[Host, list[str]]], timeout: float = RUN_TIMEOUT_S) -> list[tuple[int, str]]:
    """Run one command on each host at once (each killed with its descendants if they outlast
    ``timeout``); return each one's exit code and output."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    processes = [host.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
                 for host, args in hosts]
    results = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=timeout)
            results.append((process.returncode, output.decode(errors="replace")))
    except subprocess.TimeoutExpired:
        outputs = []
        for process in processes:
            kill_tree(process)
            outputs.append(process.communicate()[0].decode(errors="replace"))
        pytest.fail(f"the run did not end within {timeout} s; output per host:\n" + "\n---\n".join(o[-4000:] for o in outputs))
    finally:
        for process in processes:
            kill_tree(process)
    return results


@pytest.fixture(scope="module")
def node_local_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that host B's Ray node sees as its own empty one (its own disk)."""
    return tmp_path_factory.mktemp("node_local")


@pytest.fixture(scope="module")
def ray_cluster(two_hosts: HostNetwork, node_local_dir: Path) -> Iterator[RayCluster]:
    """Ray head on host A, one worker node on host B; one CPU each."""
    host_a, host_b = two_hosts.hosts
    cluster = RayCluster(host_a, [host_b], cpus=1, node_local_dirs=[str(node_local_dir)])
    try:
        yield cluster.start()
    finally:
        cluster.stop()


# -- the hosts themselves -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_by_address_while_the_hostname_is_loopback(two_hosts: HostNetwork) -> None:
    host_a, host_b = two_hosts.hosts
    port = free_port(host_b)
    listener = host_b.popen([sys.executable, "-c", "import socket, sys; s = socket.socket(); "
                             "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); s.accept()",
                             host_b.address, str(port)])
    try:
        wait_listening(host_a, host_b.address, port, timeout_s=30, process=listener)
    finally:
        listener.kill()
        listener.wait()
    assert not host_b.reachable("127.0.0.1", port), "host B's port must not be on host A's loopback"
    resolved = host_b.run([sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"])
    if not resolved.stdout.strip().startswith("127."):
        pytest.skip(f"the hostname resolves to {resolved.stdout.strip()} here, not loopback (the trap is absent)")


# -- Ray --------------------------------------------------------------------------------------------


def ray_driver(cluster: RayCluster, storage_path: str) -> tuple[int, str]:
    """Run tests/scripts/two_host_ray_job.py on the head's host; its exit code and output."""
    args = [sys.executable, str(SCRIPTS / "two_host_ray_job.py"), cluster.address, storage_path]
    ((code, output),) = run_on([(cluster.head, args)])
    return code, output


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_ray_run_spans_both_hosts(ray_cluster: RayCluster, tmp_path: Path) -> None:
    host_a, host_b = ray_cluster.head, ray_cluster.workers[0]
    code, output = ray_driver(ray_cluster, str(tmp_path))
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert code == 0 and lines, f"the two-host run failed:\n{output[-6000:]}\n{ray_cluster.logs()}"
    result = json.loads(lines[-1].split(" ", 1)[1])
    assert result["metrics"]["sum"] == 3.0, "the all-reduce must add both ranks' values"
    assert result["metrics"]["hosts"] == [host_a.address, host_b.address], "rank 0 on the driver's host, rank 1 on B"
    assert result["metrics"]["ifname"] == host_a.interface, "rank 0's gloo must use host A's interface"
    assert result["checkpoint_files"] == ["rank0.txt", "rank1.txt"]
    assert Path(result["checkpoint_path"], "rank1.txt").read_text() == "1", "host B's rank wrote into shared storage"


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_ray_storage_host_b_cannot_see_is_refused(ray_cluster: RayCluster, node_local_dir: Path) -> None:
    storage = node_local_dir / "results"
    code, output = ray_driver(ray_cluster, str(storage))
    assert code != 0, f"the run must fail:\n{output[-4000:]}"
    assert "must be shared" in output, output[-6000:]
    assert not list(storage.glob("two_hosts/checkpoint_*")), "no checkpoint may be committed"


# -- torchrun ---------------------------------------------------------------------------------------


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_torchrun_two_nodes_on_two_hosts(two_hosts: HostNetwork, tmp_path: Path) -> None:
    host_a, host_b = two_hosts.hosts
    port = free_port(host_a)
    commands = [
        (host, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                f"--node_rank={node_rank}", f"--master_addr={host_a.address}", f"--master_port={port}",
                "--max-restarts=0", str(SCRIPTS / "torchrun_job.py"), str(tmp_path)])
        for node_rank, host in enumerate((host_a, host_b))
    ]
    outcomes = run_on(commands)
    output = "\n---\n".join(text[-4000:] for _, text in outcomes)
    assert [code for code, _ in outcomes] == [0, 0], f"torchrun failed:\n{output}"
    results = {}
    for _, text in outcomes:
        for line in text.splitlines():
            if line.startswith("RANK "):
                _, rank, _, _, _, summary = line.split(" ", 5)
                results[int(rank)] = json.loads(summary)
    assert sorted(results) == [0, 1], output
    assert results[0]["metrics"]["sum"] == 2.0, "the all-reduce must add both ranks' ones"
    assert results[0]["checkpoint_files"] == {"rank0.txt": "1", "rank1.txt": "1"}
    assert results[1]["path"] == results[0]["path"] and results[1]["error"] is None
