"""A description of the machine a benchmark ran on, shared by the benchmark scripts."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from pathlib import Path


def _cpu_model() -> str:
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f}"
    except OSError:
        pass
    return "unknown"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe_machine() -> dict[str, str]:
    """nproc, CPU model, memory, Python, torch and Ray versions, load average at start, date."""
    import torch

    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": _cpu_model(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": _version("ray"),
        "loadavg_at_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def machine_line(info: dict[str, str]) -> str:
    """One line for a table's heading: the machine and the date."""
    return (
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), {info.get('memory_gib', '?')} GiB, Python {info['python']}, "
        f"torch {info['torch']}, Ray {info.get('ray', '?')}, load average at start {info['loadavg_at_start']}; "
        f"{info['date']}"
    )
