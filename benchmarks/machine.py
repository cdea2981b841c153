"""A description of the machine a benchmark ran on, shared by the benchmark scripts."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path


def describe_machine() -> dict[str, str]:
    """nproc, CPU model, Python and torch versions, load average at start, date."""
    import torch

    model = "unknown"
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": model,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_at_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
