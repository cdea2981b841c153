"""Cost of a large CPU tensor captured by the train function (seed scripts capture whole datasets):
``fit()`` wall time and the peak memory of driver + workers, by the size of the tensor.

Memory is the peak over time of the sum of PSS (``/proc/<pid>/smaps_rollup``: pages shared by k
processes count 1/k in each) over this process and its descendants, sampled every 0.02 s; the
driver's own tensor is included. The train function (2 workers) reads the tensor once and
reports. After one untimed fit(), each size runs ``--repeats`` times, interleaved; medians.

    .venv/bin/python benchmarks/payload_bench.py [--sizes-mb 0 256] [--repeats 3] [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from machine import describe_machine, machine_line  # noqa: E402 - benchmarks/ is the script folder
from record import add_results_args, write_result  # noqa: E402

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

MIB = 2**20
SAMPLE_INTERVAL_S = 0.02


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
        while True:  # a sample at once: a fit() of warm workers can take under 0.1 s
            self.peak = max(self.peak, sum(pss(pid) for pid in tree(os.getpid())))
            if self._stop_event.wait(SAMPLE_INTERVAL_S):
                return

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
        TorchTrainer(
            train_fn, scaling_config=ScalingConfig(num_workers=2), run_config=RunConfig(storage_path=storage)
        ).fit()
    return time.perf_counter() - started, sampler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a check that it works, not a measurement: 1 repeat; results marked quick"
    )
    add_results_args(parser)
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    command = shlex.join([sys.executable, *sys.argv])
    info = describe_machine()
    runs: dict[int, list[tuple[float, int]]] = {size: [] for size in args.sizes_mb}
    one_run(0)  # untimed: the first fit() of a process also waits for the warm process to be ready
    for repeat in range(args.repeats):  # interleaved: every size once per repeat, the order rotated
        shift = repeat % len(args.sizes_mb)
        for size in args.sizes_mb[shift:] + args.sizes_mb[:shift]:
            runs[size].append(one_run(size))
            print(f"[{repeat + 1}/{args.repeats}] {size} MiB: {runs[size][-1][0]:.2f} s", file=sys.stderr, flush=True)
    summary = {
        size: {
            "wall_median_s": statistics.median(wall for wall, _ in values),
            "peak_pss_median_bytes": statistics.median(peak for _, peak in values),
        }
        for size, values in runs.items()
    }
    lines = [
        machine_line(info),
        f"Command: `{command}`",
        f"{args.repeats} interleaved repeat(s), medians; fit() wall time in one driver process, after one "
        "untimed fit() (the first of a process also waits for the warm process).",
        "",
        "| captured tensor (MiB) | fit() wall median (s) | peak PSS, driver + workers (MiB) |",
        "|---:|---:|---:|",
    ]
    lines += [
        f"| {size} | {row['wall_median_s']:.2f} | {row['peak_pss_median_bytes'] / MIB:.0f} |"
        for size, row in summary.items()
    ]
    text = "\n".join(lines)
    print(text)
    largest, smallest = max(args.sizes_mb), min(args.sizes_mb)
    headline = [
        {
            "what": f"fit() with a {largest} MiB tensor in the train function's closure",
            "lockstep": f"{summary[largest]['wall_median_s']:.2f} s, "
            f"{summary[largest]['peak_pss_median_bytes'] / MIB:,.0f} MiB PSS",
            "compared_with": f"{smallest} MiB: {summary[smallest]['wall_median_s']:.2f} s, "
            f"{summary[smallest]['peak_pss_median_bytes'] / MIB:,.0f} MiB",
            "ratio": "",
        }
    ]
    document = {
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "summary": summary,
        "raw": {
            size: [{"wall_s": wall, "peak_pss_bytes": peak} for wall, peak in values] for size, values in runs.items()
        },
    }
    path = write_result(args.results_dir, "payload", command, info, args.quick, document, [], text, headline)
    if path is not None:
        print(f"results: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
