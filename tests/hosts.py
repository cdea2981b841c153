"""Test hosts: network namespaces that act as separate machines on one private network.

Each :class:`Host` is a network namespace with ``lo`` up and one interface (named after the
host, so no two hosts share an interface name, as on real clusters) holding its own address on
a private subnet. The hosts hang off a bridge that lives in a further namespace (the "switch"),
so any host can be cut off with :meth:`HostNetwork.cut` and joined again with
:meth:`HostNetwork.restore`. Every host has a default route through its interface, as a real
machine has, so code that asks "which address do I go out on" (Ray does) gets the host's own.

The namespaces share the filesystem and the hostname with the machine running the tests. Each
host gets an /etc/hosts of its own (``/etc/netns/<name>/hosts``, which ``ip netns exec``
mounts over /etc/hosts) in which the hostname resolves to ``127.0.1.1``, as on a Debian machine:
a process asking for its address by hostname gets loopback, the trap multi-host runs must avoid,
on every machine the tests run on.

Everything the network makes is named ``ls<pid><n>...`` (pid of the test session, a counter),
and :meth:`HostNetwork.close` kills every process inside the namespaces by pid, deletes them
(which deletes their links), and checks that nothing is left. Needs root and ``ip netns``;
:func:`unavailable_reason` says why not, for ``pytest.skip``.

Use::

    with HostNetwork(2) as network:
        host_a, host_b = network.hosts
        process = host_b.popen([sys.executable, "-c", "..."], env=env)

and :class:`RayCluster` to run a Ray head on one host and worker nodes on others.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET_PREFIX = "10.213"
TEARDOWN_WAIT_S = 15.0
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why test hosts can't be made here (not root, no ``ip``, namespaces refused), or None."""
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"ls{os.getpid()}probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    """One test host: a network namespace with one address.

    Attributes:
        name: The namespace's name.
        address: The host's IPv4 address.
        interface: The interface (inside the namespace) that holds ``address``.
    """

    name: str
    address: str
    interface: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command line that runs them on this host."""
        return ["ip", "netns", "exec", self.name, *args]

    def popen(
        self, args: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen[bytes]:
        """Start ``args`` on this host (killed at teardown if still running)."""
        process = subprocess.Popen(self.command(args), env=dict(env) if env is not None else None, **kwargs)  # type: ignore[call-overload]
        self.processes.append(process)
        return process

    def run(
        self, args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120, **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` on this host to its end (text output captured)."""
        return subprocess.run(
            self.command(args),
            env=dict(env) if env is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )  # type: ignore[call-overload]

    def pids(self) -> list[int]:
        """Every process in this host's namespace now."""
        listed = _ip("netns", "pids", self.name, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    def kill_all(self) -> None:
        """SIGKILL every process in the namespace and reap those this host started."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=TEARDOWN_WAIT_S)

    def reachable(self, address: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from this host to ``address:port`` succeeds now."""
        probe = (
            "import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), "
            f"timeout={timeout}).close()\nexcept OSError:\n sys.exit(1)"
        )
        return self.run([sys.executable, "-c", probe, address, str(port)], timeout=timeout + 30).returncode == 0


class HostNetwork:
    """``count`` test hosts (2 or more) on one bridged private subnet; a context manager.

    Attributes:
        hosts: The hosts, ``10.213.<n>.1`` first, then ``.2``, ...
        prefix: The name every namespace and link of this network starts with.
    """

    def __init__(self, count: int = 2) -> None:
        if count < 1 or count > 9:
            raise ValueError(f"a HostNetwork has 1 to 9 hosts, not {count}")
        number = next(_counter)
        self.prefix = f"ls{os.getpid()}{number}"
        self.subnet = f"{SUBNET_PREFIX}.{number % 250}"
        self.switch = f"{self.prefix}sw"
        self.hosts = [
            Host(
                f"{self.prefix}{chr(ord('a') + index)}",
                f"{self.subnet}.{index + 1}",
                f"{self.prefix}{chr(ord('a') + index)}e",
            )
            for index in range(count)
        ]
        self._made: list[str] = []

    def __enter__(self) -> HostNetwork:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            _ip("netns", "add", host.name)
            self._made.append(host.name)
            _write_trap_hosts_file(host.name)
            _ip("-n", host.name, "link", "set", "lo", "up")
            port = f"{host.name}p"
            _ip("link", "add", host.interface, "type", "veth", "peer", "name", port)
            _ip("link", "set", host.interface, "netns", host.name)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.name, "link", "set", host.interface, "up")
            _ip("-n", host.name, "route", "add", "default", "dev", host.interface)

    def host(self, name: str) -> Host:
        """The host whose namespace is ``name``, or whose letter (``"a"``, ``"b"``) it is."""
        for host in self.hosts:
            if name in (host.name, host.name[len(self.prefix) :]):
                return host
        raise KeyError(name)

    def cut(self, host: Host) -> None:
        """Cut ``host`` off the network (its interface goes down; its processes live on)."""
        _ip("-n", host.name, "link", "set", host.interface, "down")

    def restore(self, host: Host) -> None:
        """Join ``host`` to the network again after :meth:`cut`."""
        _ip("-n", host.name, "link", "set", host.interface, "up")
        _ip("-n", host.name, "route", "replace", "default", "dev", host.interface)

    def close(self) -> None:
        """Kill every process on every host, delete the namespaces and links, and check that
        nothing is left.

        Raises:
            AssertionError: a process, namespace or link outlived the teardown.
        """
        deadline = time.monotonic() + TEARDOWN_WAIT_S
        for host in self.hosts:
            if host.name in self._made:
                host.kill_all()
        left = {host.name: host.pids() for host in self.hosts if host.name in self._made}
        while any(left.values()) and time.monotonic() < deadline:
            for host in self.hosts:
                if left.get(host.name):
                    host.kill_all()
            time.sleep(0.1)
            left = {name: pids for name, pids in ((h.name, h.pids()) for h in self.hosts if h.name in self._made)}
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        self._made = []
        namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
        links = [line for line in _ip("-o", "link").stdout.splitlines() if self.prefix in line]
        assert not any(left.values()), f"processes outlived the test hosts' teardown: {left}"
        assert not [name for name in namespaces if name.startswith(self.prefix)], f"namespaces left: {namespaces}"
        assert not links, f"links left: {links}"


def descendants(pid: int) -> list[int]:
    """Every process descended from ``pid`` now (children first found, any depth)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop()
        found.append(child)
        queue.extend(children.get(child, []))
    return found


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` and every process descended from it (a launcher's workers may sit
    in sessions of their own), and reap ``process``."""
    for pid in [*descendants(process.pid), process.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def free_port(host: Host) -> int:
    """A TCP port that is free on ``host`` (each host has its own ports)."""
    found = host.run(
        [sys.executable, "-c", "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"],
        timeout=30,
    )
    return int(found.stdout.strip())


def wait_listening(
    host: Host, address: str, port: int, timeout_s: float, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Wait until ``address:port`` accepts connections from ``host``.

    Raises:
        TimeoutError: it did not within ``timeout_s``, or ``process`` ended first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise TimeoutError(f"the process meant to listen on {address}:{port} exited ({process.returncode})")
        if host.reachable(address, port):
            return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listened on {address}:{port} within {timeout_s:g} s")


# -- a Ray cluster on test hosts ------------------------------------------------------------------


class RayCluster:
    """A Ray head on ``head`` and one worker node on each of ``workers``, each started with
    ``ray start --block`` inside its host (so the process is ours), its own ``--temp-dir`` and
    ``cpus`` CPUs (the head ``head_cpus`` when given). Its processes are stopped by :meth:`stop`
    (or the network's teardown).

    Each folder in ``node_local_dirs`` is, on the worker nodes, an empty folder of their own (a
    tmpfs mounted in a mount namespace of the node's processes), as if it lay on each worker
    machine's own disk: storage there is *not* shared with the head's host.

    Attributes:
        address: The head's GCS address, ``HOST:PORT``, for ``ray.init(address=...)``.
    """

    GCS_PORT = 6379

    def __init__(
        self,
        head: Host,
        workers: Sequence[Host],
        cpus: int = 1,
        env: Mapping[str, str] | None = None,
        node_local_dirs: Sequence[str] = (),
        head_cpus: int | None = None,
    ) -> None:
        self.head = head
        self.node_local_dirs = list(node_local_dirs)
        self.workers = list(workers)
        self.cpus = cpus
        self.head_cpus = cpus if head_cpus is None else head_cpus
        # Token auth off: it turns itself on when ~/.ray holds a token, and the test's nodes and
        # drivers would then disagree; the cluster lives on a private test network.
        self.env = {
            **(env if env is not None else _untagged_environ()),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled",
        }
        self.address = f"{head.address}:{self.GCS_PORT}"
        self.temp_root = Path(tempfile.mkdtemp(prefix="lsray"))
        self.processes: list[tuple[Host, subprocess.Popen[bytes]]] = []

    def temp_dir(self, host: Host) -> str:
        """The Ray temp dir of ``host``'s node (also the one its drivers must use)."""
        return str(self.temp_root / host.name)

    def _start_node(self, host: Host, head: bool) -> subprocess.Popen[bytes]:
        ray = str(Path(sys.executable).with_name("ray"))
        role = (
            ["--head", f"--port={self.GCS_PORT}", "--include-dashboard=false"]
            if head
            else [f"--address={self.address}"]
        )
        args = [
            ray,
            "start",
            "--block",
            *role,
            f"--node-ip-address={host.address}",
            f"--num-cpus={self.head_cpus if head else self.cpus}",
            "--num-gpus=0",
            f"--temp-dir={self.temp_dir(host)}",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
        ]
        if not head and self.node_local_dirs:
            mounts = " && ".join(
                f"mount -t tmpfs lockstep-node-local {shlex.quote(path)}" for path in self.node_local_dirs
            )
            args = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *args]
        log = open(self.temp_root / f"{host.name}.log", "wb")  # noqa: SIM115 - the child holds it
        process = host.popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.processes.append((host, process))
        return process

    def start(self, timeout_s: float = 120) -> RayCluster:
        """Start the head, wait for its GCS, then start the worker nodes."""
        head = self._start_node(self.head, head=True)
        wait_listening(self.head, self.head.address, self.GCS_PORT, timeout_s, head)
        for worker in self.workers:
            self._start_node(worker, head=False)
        return self

    def restart(self, worker: Host) -> None:
        """Kill everything on ``worker`` and start its node again (a node Ray marked dead, after
        a cut, does not rejoin by itself). Drivers wait for it to be alive themselves."""
        worker.kill_all()
        self._start_node(worker, head=False)

    def logs(self) -> str:
        """The tail of every node's ``ray start`` output (for failure messages)."""
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.temp_root.glob("*.log"))
        )

    def stop(self) -> None:
        """Kill every process on the cluster's hosts (Ray's daemons and workers included)."""
        for host in [self.head, *self.workers]:
            host.kill_all()
        shutil.rmtree(self.temp_root, ignore_errors=True)


def _untagged_environ() -> dict[str, str]:
    """This process's environment without the test-session tag: long-lived helpers (a Ray
    cluster shared by a module's tests) must not count as a test's leftover processes."""
    return {key: value for key, value in os.environ.items() if key != "LOCKSTEP_TEST_TAG"}


NETNS_ETC = Path("/etc/netns")


def _write_trap_hosts_file(namespace: str) -> None:
    """The /etc/hosts that processes on ``namespace`` see: the hostname on loopback (the trap)."""
    folder = NETNS_ETC / namespace
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{socket.gethostname()}\n::1\tlocalhost\n")


def driver_command(host: Host, script: str, *args: str) -> list[str]:
    """The command line that runs ``script`` with this Python on ``host``."""
    return host.command([sys.executable, script, *args])


def torchrun_commands(hosts: Sequence[Host], script: str, *args: str) -> list[tuple[Host, list[str]]]:
    """``(host, command)`` for one torchrun per host, one rank each, the first host holding the
    rendezvous (on a free port of its own), with no restarts: ``script`` and ``args`` on every host."""
    master = hosts[0]
    port = free_port(master)
    return [
        (
            host,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={len(hosts)}",
                "--nproc_per_node=1",
                f"--node_rank={node_rank}",
                f"--master_addr={master.address}",
                f"--master_port={port}",
                "--max-restarts=0",
                script,
                *args,
            ],
        )
        for node_rank, host in enumerate(hosts)
    ]
