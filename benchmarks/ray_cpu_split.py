"""Where the CPU of a many-rank run on Ray goes: ray_many_bench's job, split by process.

On a 4-raylet cluster on this machine (as ``ray_many_bench.py`` starts it), runs
``jobs/ddp_many_lockstep.py --spread`` once per variant asked for and samples ``/proc`` every
0.1 s meanwhile: the CPU time (user + system) of every process of this machine, grouped as the
job's driver, Ray's worker processes (one per actor: the ranks), Ray's own processes (raylets,
GCS, the per-node agents) and anything else. A process that ends between two samples loses at
most its last 0.1 s. It prints, per variant: fit() and whole-process times, the CPU seconds of
each group over the run, the workers' count and median CPU each, and the spread of the workers'
start times (from the launch). Each rank also writes its own marks (``--marks-dir`` of the job):
its process's CPU seconds and age at the train function's start, once ``prepare_model`` returned
(DDP's constructor imports ``torch._dynamo``) and at its end. Two CPUs do ``2 x wall``
CPU-seconds at most: when the sum comes near it, the run waits for CPU, and only less CPU work
shortens it.

    .venv/bin/python benchmarks/ray_cpu_split.py [--ranks 16] [--variants lockstep ray_train] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from jobrunner import JOBS
from machine import describe_machine, machine_line
from ray_many_bench import VARIANTS, start_cluster
from record import add_results_args, write_result

TICKS = os.sysconf("SC_CLK_TCK")
BOOT_TIME_S = next(
    float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
)
RAY_SYSTEM = ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py", "ray_client_server")


def cpu_and_start(pid: int) -> tuple[float, float] | None:
    """(CPU seconds so far, start time as a Unix time) of ``pid``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS, BOOT_TIME_S + int(fields[19]) / TICKS


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Sampler:
    """Samples every process's CPU every 0.1 s on a thread until stopped."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, Any]] = {}
        self.before = {pid: cpu_and_start(pid) for pid in self._pids()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _pids() -> list[int]:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for pid in self._pids():
                now = cpu_and_start(pid)
                if now is None or pid == os.getpid():
                    continue
                entry = self.seen.setdefault(pid, {"start": now[1], "command": command_of(pid), "cpu": 0.0})
                earlier = self.before.get(pid)
                same_process = earlier is not None and abs(earlier[1] - now[1]) < 0.5
                entry["cpu"] = now[0] - (earlier[0] if same_process else 0.0)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def group_of(command: str, driver_pid: int, pid: int) -> str:
    if pid == driver_pid:
        return "driver"
    if "default_worker.py" in command:
        return "ray workers"
    if "lockstep._internal.warm.zygote" in command:  # a node's warm process, and the ranks it forked
        return "warm processes and forked ranks"
    if any(name in command for name in RAY_SYSTEM) or "/ray/" in command:
        return "ray system"
    return "other"


MARKS = ("train_start", "model_prepared", "train_end")


def rank_marks(folder: Path) -> dict[str, dict[str, float]]:
    """Per mark, the median over ranks of the CPU seconds and the age (seconds since the rank's
    process started) each rank had reached there."""
    ranks = [json.loads(path.read_text()) for path in folder.glob("rank*.json")]
    return (
        {
            mark: {
                "cpu_s": statistics.median(rank[mark][0] for rank in ranks),
                "age_s": statistics.median(rank[mark][1] for rank in ranks),
            }
            for mark in MARKS
        }
        if ranks
        else {}
    )


def one_variant(variant: str, ranks: int, steps: int, address: str, folder: Path) -> dict[str, Any]:
    env = {**os.environ, "RAY_ADDRESS": address}
    marks_dir = folder / f"marks_{variant}"
    marks_dir.mkdir()
    command = [
        sys.executable,
        str(JOBS / "ddp_many_lockstep.py"),
        f"--num-workers={ranks}",
        f"--steps={steps}",
        "--spread",
        f"--storage-path={folder / 'runs'}",
        f"--marks-dir={marks_dir}",
        VARIANTS[variant][0],
    ]
    launched = time.time()
    with Sampler() as sampler:
        job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=JOBS)
        output, _ = job.communicate(timeout=900)
    wall = time.time() - launched
    fit_s = json.loads(output.split("BENCH_JSON ", 1)[1].splitlines()[0])["fit_s"]
    groups: dict[str, float] = {}
    worker_cpu, worker_starts = [], []
    for pid, entry in sampler.seen.items():
        group = group_of(entry["command"], job.pid, pid)
        groups[group] = groups.get(group, 0.0) + entry["cpu"]
        if group == "ray workers" and entry["start"] >= launched - 1 and entry["cpu"] > 0.05:
            worker_cpu.append(entry["cpu"])
            worker_starts.append(entry["start"] - launched)
    return {
        "fit_s": fit_s,
        "wall_s": wall,
        "cpu_s": groups,
        "workers": len(worker_cpu),
        "marks": rank_marks(marks_dir),
        "worker_cpu_median_s": statistics.median(worker_cpu) if worker_cpu else 0.0,
        "worker_start_s": [min(worker_starts, default=0.0), max(worker_starts, default=0.0)],
    }


def describe(variant: str, result: dict[str, Any]) -> str:
    cpu = ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(result["cpu_s"].items()))
    line = (
        f"{VARIANTS[variant][1]}: fit {result['fit_s']:.1f} s, whole {result['wall_s']:.1f} s "
        f"(2 CPUs: {2 * result['wall_s']:.0f} CPU-s at most); CPU-s: {cpu}; "
        f"total {sum(result['cpu_s'].values()):.1f}; "
        f"{result['workers']} Ray workers, median {result['worker_cpu_median_s']:.2f} CPU-s each, started "
        f"{result['worker_start_s'][0]:.1f}-{result['worker_start_s'][1]:.1f} s after launch"
    )
    marks = "; ".join(
        f"{mark} at {figures['cpu_s']:.2f} CPU-s, {figures['age_s']:.1f} s old"
        for mark, figures in result["marks"].items()
    )
    return line + (f"\n  a rank's process, medians over ranks: {marks}" if marks else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    add_results_args(parser)
    args = parser.parse_args(argv)
    info = describe_machine()
    cluster = start_cluster()
    found, lines = {}, [machine_line(info)]
    try:
        with tempfile.TemporaryDirectory(prefix="lockstep_ray_split_") as folder:
            for variant in args.variants:
                found[variant] = one_variant(variant, args.ranks, args.steps, cluster.address, Path(folder))
                lines.append(describe(variant, found[variant]))
                print(lines[-1], flush=True)
    finally:
        cluster.shutdown()
    command = "python benchmarks/ray_cpu_split.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    path = write_result(
        args.results_dir,
        "ray-cpu-split",
        command,
        info,
        False,
        {"samples": found, "config": vars(args) | {"results_dir": str(args.results_dir)}},
        [],
        "\n".join(lines),
    )
    if path is not None:
        print(f"results: {path}")


if __name__ == "__main__":
    main()
