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
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from hosts import Host, HostNetwork, RayCluster, free_port, kill_tree, torchrun_commands, wait_listening

SCRIPTS = REPO_ROOT / "tests" / "scripts"
RUN_TIMEOUT_S = 150


def run_on(
    hosts: Sequence[tuple[Host, list[str]]], timeout: float = RUN_TIMEOUT_S, **extra_env: str
) -> list[tuple[int, str]]:
    """Run one command on each host at once (each killed with its descendants if they outlast
    ``timeout``); return each one's exit code and output."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **extra_env}
    processes = [
        host.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        for host, args in hosts
    ]
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
        pytest.fail(
            f"the run did not end within {timeout} s; output per host:\n" + "\n---\n".join(o[-4000:] for o in outputs)
        )
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
    listener = host_b.popen(
        [
            sys.executable,
            "-c",
            "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); s.accept()",
            host_b.address,
            str(port),
        ]
    )
    try:
        wait_listening(host_a, host_b.address, port, timeout_s=30, process=listener)
    finally:
        listener.kill()
        listener.wait()
    assert not host_b.reachable("127.0.0.1", port), "host B's port must not be on host A's loopback"
    resolved = host_b.run([sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"])
    assert resolved.stdout.strip() == "127.0.1.1", "the test hosts' /etc/hosts must set the trap (hostname on loopback)"


# -- Ray --------------------------------------------------------------------------------------------


def ray_driver(cluster: RayCluster, storage_path: str, *options: str) -> tuple[int, str]:
    """Run tests/scripts/two_host_ray_job.py on the head's host; its exit code and output."""
    args = [sys.executable, str(SCRIPTS / "two_host_ray_job.py"), cluster.address, storage_path, *options]
    ((code, output),) = run_on([(cluster.head, args)])
    return code, output


def assert_run_spanned_both_hosts(cluster: RayCluster, code: int, output: str) -> None:
    """The driver's RESULT line shows a run whose two ranks ran on host A and host B."""
    host_a, host_b = cluster.head, cluster.workers[0]
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert code == 0 and lines, f"the two-host run failed:\n{output[-6000:]}\n{cluster.logs()}"
    result = json.loads(lines[-1].split(" ", 1)[1])
    assert result["metrics"]["sum"] == 3.0, "the all-reduce must add both ranks' values"
    assert result["metrics"]["hosts"] == [host_a.address, host_b.address], "rank 0 on the driver's host, rank 1 on B"
    assert result["metrics"]["ifname"] == host_a.interface, "rank 0's gloo must use host A's interface"
    assert result["checkpoint_files"] == {"rank0.txt": "1", "rank1.txt": "1"}, "both hosts' ranks wrote to storage"


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_ray_run_spans_both_hosts(ray_cluster: RayCluster, tmp_path: Path) -> None:
    assert_run_spanned_both_hosts(ray_cluster, *ray_driver(ray_cluster, str(tmp_path)))


@pytest.mark.timeout(RUN_TIMEOUT_S + 90)
def test_ray_run_on_s3_both_hosts_reach(ray_cluster: RayCluster) -> None:
    host_a, host_b = ray_cluster.head, ray_cluster.workers[0]
    port = free_port(host_a)
    moto = str(Path(sys.executable).with_name("moto_server"))
    server = host_a.popen(
        [moto, "-H", host_a.address, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    aws = {
        "AWS_ENDPOINT_URL": f"http://{host_a.address}:{port}",
        "AWS_ACCESS_KEY_ID": "lockstep-test",
        "AWS_SECRET_ACCESS_KEY": "lockstep-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in aws}
    try:
        wait_listening(host_b, host_a.address, port, timeout_s=60, process=server)
        os.environ.update(aws)
        made = host_a.run([sys.executable, "-c", "import s3fs; s3fs.S3FileSystem().mkdir('runs')"], env=os.environ)
        assert made.returncode == 0, made.stderr
        outcome = ray_driver(ray_cluster, "s3://runs/two_hosts", "--forward-env", ",".join(aws))
        assert_run_spanned_both_hosts(ray_cluster, *outcome)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        kill_tree(server)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_ray_storage_host_b_cannot_see_is_refused(ray_cluster: RayCluster, node_local_dir: Path) -> None:
    storage = node_local_dir / "results"
    code, output = ray_driver(ray_cluster, str(storage))
    assert code != 0, f"the run must fail:\n{output[-4000:]}"
    assert "must be shared" in output, output[-6000:]
    from lockstep import Result

    run = Result.from_path(str(storage / "two_hosts"))  # as the driver (host A) recorded it
    assert run.checkpoint is None and not run.best_checkpoints, "no checkpoint may be committed"
    assert run.error is not None or not run.metrics_history, "the run must not have gone on"


# -- torchrun ---------------------------------------------------------------------------------------


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_torchrun_two_nodes_on_two_hosts(two_hosts: HostNetwork, tmp_path: Path) -> None:
    commands = torchrun_commands(two_hosts.hosts, str(SCRIPTS / "torchrun_job.py"), str(tmp_path))
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


@pytest.mark.timeout(150)
def test_torchrun_ranks_that_cannot_connect_all_fail_within_the_start_timeout(
    two_hosts: HostNetwork, tmp_path: Path
) -> None:
    commands = torchrun_commands(two_hosts.hosts, str(SCRIPTS / "torchrun_job.py"), str(tmp_path), "--start-timeout=10")
    started = time.monotonic()
    outcomes = run_on(commands, timeout=100, GLOO_SOCKET_IFNAME="lo")  # the user's wrong choice: loopback
    output = "\n---\n".join(text[-4000:] for _, text in outcomes)
    elapsed = time.monotonic() - started
    print(f"both torchruns ended after {elapsed:.1f} s")
    assert elapsed < 100
    assert all(code != 0 for code, _ in outcomes), f"every rank's fit() must fail:\n{output}"
    assert "could not join the process group within 10 s" in output, output
    assert "GLOO_SOCKET_IFNAME" in output


# -- the interface choice ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_each_host_names_its_own_interface_and_the_users_choice_wins(two_hosts: HostNetwork) -> None:
    host_a, host_b = two_hosts.hosts
    probe = (
        "import json, sys\nfrom lockstep._internal.executors.torchrun_store import Launch\n"
        "from lockstep._internal.rank.rank_env import RankEnv\n"
        "launch = Launch.from_environ()\n"
        "print(json.dumps([launch.rank_env.node_addr, launch.rank_env.socket_variables({}),"
        " launch.rank_env.socket_variables({'GLOO_SOCKET_IFNAME': 'mine'})]))"
    )
    launcher_env = {
        **os.environ,
        "RANK": "1",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": host_a.address,
        "MASTER_PORT": "29500",
    }
    answer = host_b.run([sys.executable, "-c", probe], env=launcher_env)
    assert answer.returncode == 0, answer.stderr
    node_addr, chosen, with_users = json.loads(answer.stdout)
    assert node_addr == host_b.address, "under torchrun: the local address that reaches MASTER_ADDR"
    assert chosen == {"GLOO_SOCKET_IFNAME": host_b.interface, "NCCL_SOCKET_IFNAME": f"={host_b.interface}"}
    assert with_users == {"NCCL_SOCKET_IFNAME": f"={host_b.interface}"}, "a variable the user set is kept"
    local = host_b.run(
        [
            sys.executable,
            "-c",
            "from lockstep._internal.rank.rank_env import RankEnv\n"
            "print(RankEnv(0, 2, 0, 2, 0, '127.0.0.1', 1).socket_variables({}))",
        ]
    )
    assert "'GLOO_SOCKET_IFNAME': 'lo'" in local.stdout, local.stderr
