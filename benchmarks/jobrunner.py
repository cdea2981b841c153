"""Running one benchmark job as a fresh process: its command line, wall time (launch to exit),
the peak RSS of its process tree, and the ``BENCH_JSON`` lines it prints. Used by bench_jobs.py
and ray_bench.py."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOBS = HERE / "jobs"
REPO = HERE.parent
RSS_INTERVAL_S = 0.2


# -- process tree, memory ----------------------------------------------------------------------


def _parent_map() -> dict[int, int]:
    """pid -> parent pid for every process in /proc."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
    return parents


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parent_map().items():
        children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def vm_rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pss(pid: int) -> int:
    """Proportional set size of ``pid`` in bytes (its private pages, plus each shared page divided
    by the number of processes sharing it; 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
            for line in handle:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeRssSampler(threading.Thread):
    """Sums VmRSS (and, with ``with_pss``, PSS) over a process tree every ``interval`` seconds and
    keeps the peaks."""

    def __init__(self, root: int, interval: float = RSS_INTERVAL_S, with_pss: bool = False) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.interval = interval
        self.with_pss = with_pss
        self.peak_total = 0
        self.peak_pss = 0
        self.peak_root = 0
        self.peak_processes = 0
        self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while True:
            self.sample()
            if self._stop_event.wait(self.interval):
                return

    def sample(self) -> None:
        pids = process_tree(self.root)
        sizes = [vm_rss(pid) for pid in pids]
        self.samples += 1
        self.peak_total = max(self.peak_total, sum(sizes))
        self.peak_root = max(self.peak_root, sizes[0] if sizes else 0)
        self.peak_processes = max(self.peak_processes, sum(1 for size in sizes if size))
        if self.with_pss:
            self.peak_pss = max(self.peak_pss, sum(pss(pid) for pid in pids))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


# -- running one job ---------------------------------------------------------------------------


@dataclass
class Variant:
    """One way of running a job: a label and how to build its command line."""

    key: str
    label: str
    framework: str  # lockstep, torchrun, ray
    workers: int = 2
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables of the job


@dataclass
class RunResult:
    wall_s: float
    peak_rss: int | None = None
    peak_root_rss: int | None = None
    peak_processes: int | None = None
    peak_pss: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def job_command(variant: Variant, job: str, job_args: list[str], storage: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``job`` ("mlp" or "noop") for ``variant``."""
    env = {**os.environ, **dict(variant.env)}
    if variant.framework == "torchrun":
        env["OMP_NUM_THREADS"] = "1"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={variant.workers}",
            f"--master_port={free_port()}",
            str(JOBS / f"{job}_torchrun.py"),
            *job_args,
        ]
        return command, env
    command = [
        sys.executable,
        str(JOBS / f"{job}_lockstep.py"),
        f"--num-workers={variant.workers}",
        f"--storage-path={storage}",
        *job_args,
    ]
    if variant.framework == "lockstep_run":  # the launcher: `lockstep run job.py ...` (the console script)
        command[:1] = [str(Path(sys.executable).with_name("lockstep")), "run"]
    if variant.framework == "ray":
        command.append("--ray")
        env.pop("RAY_ADDRESS", None)  # Ray Train starts its own cluster, as a new user's script would
    return command, env


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every descendant still alive (one by one, by pid)."""
    for pid in reversed(process_tree(root)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def run_job(
    command: list[str], env: dict[str, str], log: Path, timeout_s: float, sample_rss: bool, sample_pss: bool = False
) -> RunResult:
    """Run ``command`` to its end; whole-process wall time, peak tree RSS (and PSS), BENCH_JSON data."""
    with open(log, "wb") as output:
        started = time.perf_counter()
        process = subprocess.Popen(
            command, env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        sampler = TreeRssSampler(process.pid, with_pss=sample_pss) if sample_rss or sample_pss else None
        if sampler is not None:
            sampler.start()
        try:
            returncode = process.wait(timeout=timeout_s)
            wall = time.perf_counter() - started
        finally:
            if sampler is not None:
                sampler.stop()
            if process.poll() is None:
                kill_tree(process.pid)
                process.wait()
    leftovers = [pid for pid in process_tree(process.pid) if pid != process.pid]
    if leftovers:  # cannot happen once the root is reaped, but never leave anything behind
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    if returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited with {returncode}; last output:\n{text[-3000:]}")
    data: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("BENCH_JSON "):
            data.update(json.loads(line[len("BENCH_JSON ") :]))
    result = RunResult(wall_s=wall, data=data)
    if sampler is not None:
        result.peak_rss, result.peak_root_rss = sampler.peak_total, sampler.peak_root
        result.peak_processes = sampler.peak_processes
        result.peak_pss = sampler.peak_pss if sample_pss else None
    return result
