"""Cost of a large CPU tensor captured by the train function (seed scripts capture whole datasets):
``fit()`` wall time and the peak memory of driver + workers, by the size of the tensor.

Memory is the peak over time of the sum of PSS (``/proc/<pid>/smaps_rollup``: pages shared by k
processes count 1/k in each) over this process and its descendants, sampled every 0.1 s; the
driver's own tensor is included. The train function (2 workers) reads the tensor once and
reports. Each size runs ``--repeats`` times; medians.

    .venv/bin/python benchmarks/payload_bench.py [--sizes-mb 0 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import torch

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

MIB = 2**20


def tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc/<pid>/task/*/children)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    todo += [int(child) for child in handle.read().split()]
        except OSError:
            continue
    return found


def pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakPss(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.1):
            self.peak = max(self.peak, sum(pss(pid) for pid in tree(os.getpid())))

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return self.peak


def one_run(size_mb: int) -> tuple[float, int]:
    captured = torch.ones(size_mb * MIB // 4)

    def train_fn() -> None:
        lockstep.report({"sum": float(captured[:1000].sum())})

    sampler = PeakPss()
    sampler.start()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as storage:
        TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=2), run_config=RunConfig(storage_path=storage)).fit()
    return time.perf_counter() - started, sampler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| captured tensor (MiB) | fit() wall median (s) | peak PSS, driver + workers (MiB) |\n|---:|---:|---:|")
    for size in args.sizes_mb:
        runs = [one_run(size) for _ in range(args.repeats)]
        print(f"| {size} | {statistics.median(wall for wall, _ in runs):.2f} | "
              f"{statistics.median(peak for _, peak in runs) / MIB:.0f} |", flush=True)


if __name__ == "__main__":
    main()
