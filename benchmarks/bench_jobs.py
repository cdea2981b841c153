"""Whole jobs on lockstep vs torchrun (hand-written DDP): wall time, start-up, report(), memory.

What it measures
----------------
Every measurement runs a job script from ``benchmarks/jobs/`` as a fresh ``python`` process and
times it from launch to exit (``subprocess.Popen`` to ``wait()``), 2 CPU workers unless said:

* **e2e**: seed 003's job (the MLP of examples/fashion_mnist_mlp.py, 784-512-128-64-10 with
  LogSoftmax, SGD lr 1e-3, global batch 64 = 32 per worker, the 60,000 training images in order,
  1 epoch, then validation on the 10,000 test images). ``jobs/mlp_lockstep.py`` uses
  ``TorchTrainer`` + ``prepare_model`` / ``prepare_data_loader`` and ``report()`` once per epoch;
  ``jobs/mlp_torchrun.py`` is the same model, data loading (torchvision ``FashionMNIST`` +
  ``ToTensor``, ``DataLoader(num_workers=0)``, read by each worker) and loops with hand-written
  DDP (gloo, ``DistributedSampler``), started by ``python -m torch.distributed.run
  --nproc_per_node=2`` with ``OMP_NUM_THREADS=1`` (lockstep gives each worker 1 thread by
  default). The lockstep job also runs with 1 worker (batch 64), to show what the second worker
  costs or saves on a 2-core machine (framework cost, not a speed-up study).
* **startup**: a no-op job: ``jobs/noop_lockstep.py`` (each worker calls ``report()`` once) vs
  ``jobs/noop_torchrun.py`` (each worker joins the gloo group and passes one barrier).
* **report**: the same no-op scripts with ``--calls 2000``: rank 0's time per metrics-only
  ``report()`` (lockstep), and per ``dist.barrier()`` (torchrun; not the same operation, shown
  only as the floor of a collective). p50 / p99 over the 2000 calls of each run (after 50 untimed
  warm-up calls), then the median over repeats.
* **peak RSS**: during every e2e run a thread of this script sums ``VmRSS`` (from
  ``/proc/<pid>/status``) over the launched process and all its descendants every 0.2 s and keeps
  the largest sum. Limits: a peak shorter than 0.2 s can be missed, and RSS counts pages shared
  between processes (torch's libraries, the page cache of mapped files) once per process, so the
  sum overstates the memory really used; it is the same yardstick for both launchers.

If ``ray`` is importable, the e2e and startup jobs also run on Ray Train (the lockstep scripts
with ``--ray``, which only swaps the imports); else the tables say "Ray Train: not installed".

Runs are interleaved: each repeat runs every variant once (lockstep, torchrun, [Ray], lockstep
1 worker), the order rotated by one from one repeat to the next. Medians over ``--repeats``.
Goals: e2e lockstep / torchrun <= 1.00, startup lockstep / torchrun <= 1.00, report() p50 <= 1 ms.

How to run
----------
From the repository root, with the project's venv::

    .venv/bin/python benchmarks/bench_jobs.py                       # about 10 minutes on 2 CPUs
    .venv/bin/python benchmarks/bench_jobs.py --quick               # 1 repeat, e2e on 10k images
    .venv/bin/python benchmarks/bench_jobs.py --only startup report --json out.json

The data is read from ``--data-dir`` (default ``$LOCKSTEP_DATA``, else ``../shared/data`` next to
the repository). Run folders and logs go to ``--work-dir`` (default: a new temporary folder,
removed at the end). Every process a run leaves behind (there should be none) is killed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from machine import describe_machine  # noqa: E402 - benchmarks/ is the script folder

HERE = Path(__file__).resolve().parent
JOBS = HERE / "jobs"
REPO = HERE.parent
MIB = 1024 * 1024
E2E_GOAL = 1.00
STARTUP_GOAL = 1.00
REPORT_P50_GOAL_S = 0.001
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
        fields = stat[stat.rfind(b")") + 2:].split()
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


class TreeRssSampler(threading.Thread):
    """Sums VmRSS over a process tree every ``interval`` seconds and keeps the peaks."""

    def __init__(self, root: int, interval: float = RSS_INTERVAL_S) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.interval = interval
        self.peak_total = 0
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


@dataclass
class RunResult:
    wall_s: float
    peak_rss: int | None = None
    peak_root_rss: int | None = None
    peak_processes: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def job_command(variant: Variant, job: str, job_args: list[str], storage: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``job`` ("mlp" or "noop") for ``variant``."""
    env = dict(os.environ)
    if variant.framework == "torchrun":
        env["OMP_NUM_THREADS"] = "1"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={variant.workers}",
                   f"--master_port={free_port()}", str(JOBS / f"{job}_torchrun.py"), *job_args]
        return command, env
    command = [sys.executable, str(JOBS / f"{job}_lockstep.py"), f"--num-workers={variant.workers}",
               f"--storage-path={storage}", *job_args]
    if variant.framework == "ray":
        command.append("--ray")
    return command, env


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every descendant still alive (one by one, by pid)."""
    for pid in reversed(process_tree(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_job(command: list[str], env: dict[str, str], log: Path, timeout_s: float, sample_rss: bool) -> RunResult:
    """Run ``command`` to its end; whole-process wall time, peak tree RSS, BENCH_JSON data."""
    with open(log, "wb") as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        sampler = TreeRssSampler(process.pid) if sample_rss else None
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
            data.update(json.loads(line[len("BENCH_JSON "):]))
    result = RunResult(wall_s=wall, data=data)
    if sampler is not None:
        result.peak_rss, result.peak_root_rss = sampler.peak_total, sampler.peak_root
        result.peak_processes = sampler.peak_processes
    return result


# -- the measurements --------------------------------------------------------------------------


def variants(ray: bool, one_worker: bool) -> list[Variant]:
    found = [Variant("lockstep", "lockstep", "lockstep"), Variant("torchrun", "torchrun + DDP", "torchrun")]
    if ray:
        found.append(Variant("ray", "Ray Train", "ray"))
    if one_worker:
        found.append(Variant("lockstep_1w", "lockstep, 1 worker", "lockstep", workers=1))
    return found


def rotated(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def measure(section: str, job: str, job_args: list[str], todo: list[Variant], args: argparse.Namespace,
            work: Path, sample_rss: bool) -> dict[str, list[RunResult]]:
    """``args.repeats`` interleaved runs of every variant of one section."""
    runs: dict[str, list[RunResult]] = {variant.key: [] for variant in todo}
    for repeat in range(args.repeats):
        for variant in rotated(todo, repeat):
            command, env = job_command(variant, job, job_args, work / "runs")
            log = work / "logs" / f"{section}_{variant.key}_{repeat}.log"
            result = run_job(command, env, log, args.timeout, sample_rss)
            runs[variant.key].append(result)
            detail = ""
            if result.peak_rss is not None:
                detail += f", peak RSS {result.peak_rss / MIB:.0f} MiB"
            for name, values in result.data.items():
                detail += f", {name} p50 {percentile(values, 50) * 1e3:.3f} ms"
            print(f"[{section} {repeat + 1}/{args.repeats}] {variant.label}: {result.wall_s:.2f} s{detail}",
                  file=sys.stderr, flush=True)
            shutil.rmtree(work / "runs", ignore_errors=True)
    return runs


def wall_stats(results: list[RunResult]) -> dict[str, Any]:
    walls = [result.wall_s for result in results]
    return {"median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls), "runs_s": walls}


def summarize(raw: dict[str, dict[str, list[RunResult]]]) -> dict[str, Any]:
    """Medians, ratios and goals."""
    summary: dict[str, Any] = {}
    for section in ("e2e", "startup"):
        if section not in raw:
            continue
        rows = {key: wall_stats(results) for key, results in raw[section].items()}
        ratio = rows["lockstep"]["median_s"] / rows["torchrun"]["median_s"]
        goal = E2E_GOAL if section == "e2e" else STARTUP_GOAL
        summary[section] = {"rows": rows, "lockstep_over_torchrun": ratio, "goal": goal, "goal_met": ratio <= goal}
        if "ray" in rows:
            summary[section]["lockstep_over_ray"] = rows["lockstep"]["median_s"] / rows["ray"]["median_s"]
        if section == "e2e":
            summary[section]["rss"] = {
                key: {"peak_total_median_bytes": statistics.median(r.peak_rss or 0 for r in results),
                      "peak_root_median_bytes": statistics.median(r.peak_root_rss or 0 for r in results),
                      "processes": max(r.peak_processes or 0 for r in results)}
                for key, results in raw[section].items()
            }
            if "lockstep_1w" in rows:
                summary[section]["two_over_one_worker"] = rows["lockstep"]["median_s"] / rows["lockstep_1w"]["median_s"]
    if "report" in raw:
        rows = {}
        for key, results in raw["report"].items():
            name = "report_s" if key == "lockstep" else "barrier_s"
            rows[key] = {
                "op": "report()" if key == "lockstep" else "dist.barrier()",
                "calls": len(results[0].data[name]),
                "p50_s": statistics.median(percentile(r.data[name], 50) for r in results),
                "p99_s": statistics.median(percentile(r.data[name], 99) for r in results),
                "max_s": max(max(r.data[name]) for r in results),
            }
        p50 = rows["lockstep"]["p50_s"]
        summary["report"] = {"rows": rows, "goal_p50_s": REPORT_P50_GOAL_S, "goal_met": p50 <= REPORT_P50_GOAL_S}
    return summary


# -- output ------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """The machine, as benchmarks/machine.py describes it."""
    return describe_machine()


def _verdict(met: bool) -> str:
    return "PASS" if met else "MISS"


def _labels(todo: list[Variant]) -> dict[str, str]:
    return {variant.key: variant.label for variant in todo}


def markdown(summary: dict[str, Any], args: argparse.Namespace, info: dict[str, str], command: str,
             labels: dict[str, str], ray: bool) -> str:
    """The results as markdown tables, with the machine and the command."""
    images = f"first {args.e2e_limit:,} training images" if args.e2e_limit else "60,000 training images"
    lines = [
        (f"Machine: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, torch {info['torch']}, "
         f"load average at start {info['loadavg_at_start']}; {info['date']}"),
        f"Command: `{command}`",
        f"{args.repeats} interleaved repeat(s), medians; whole-process wall time (launch to exit); 2 workers "
        f"unless said" + (f"; e2e = seed 003's MLP job, {images}, 1 epoch + validation on 10,000." if "e2e" in summary else "."),
        "Ray Train: installed, measured (e2e, startup)." if ray else "Ray Train: not installed",
        "",
    ]
    if "e2e" in summary or "startup" in summary:
        lines += ["| job | launcher | wall median (s) | min (s) | max (s) |", "|---|---|---:|---:|---:|"]
        for section in ("e2e", "startup"):
            for key, row in summary.get(section, {}).get("rows", {}).items():
                lines.append(f"| {section} | {labels[key]} | {row['median_s']:.2f} | {row['min_s']:.2f} | {row['max_s']:.2f} |")
        lines.append("")
    if "e2e" in summary:
        e2e = summary["e2e"]
        if "two_over_one_worker" in e2e:
            lines += [
                "| lockstep e2e | wall median (s) |", "|---|---:|",
                f"| 1 worker (batch 64) | {e2e['rows']['lockstep_1w']['median_s']:.2f} |",
                f"| 2 workers (batch 32 each) | {e2e['rows']['lockstep']['median_s']:.2f} |",
                f"| 2 workers / 1 worker | {e2e['two_over_one_worker']:.2f} |", "",
            ]
        lines += ["| e2e peak RSS (sampled every 0.2 s) | driver + workers, sum (MiB) | driver / launcher alone (MiB) | processes |",
                  "|---|---:|---:|---:|"]
        for key, row in e2e["rss"].items():
            lines.append(f"| {labels[key]} | {row['peak_total_median_bytes'] / MIB:.0f} | "
                         f"{row['peak_root_median_bytes'] / MIB:.0f} | {row['processes']} |")
        lines.append("")
    if "report" in summary:
        lines += ["| 2 workers, rank 0 | operation | calls per run | p50 (ms) | p99 (ms) | max (ms) |",
                  "|---|---|---:|---:|---:|---:|"]
        for key, row in summary["report"]["rows"].items():
            note = "" if key == "lockstep" else " (for comparison, not a report)"
            lines.append(f"| {labels[key]} | {row['op']}{note} | {row['calls']} | {row['p50_s'] * 1e3:.3f} | "
                         f"{row['p99_s'] * 1e3:.3f} | {row['max_s'] * 1e3:.2f} |")
        lines.append("")
    lines += ["| goal | measured | result |", "|---|---:|---|"]
    for section in ("e2e", "startup"):
        if section in summary:
            entry = summary[section]
            lines.append(f"| {section}: lockstep / torchrun <= {entry['goal']:.2f} | {entry['lockstep_over_torchrun']:.3f} | "
                         f"{_verdict(entry['goal_met'])} |")
    if "report" in summary:
        p50 = summary["report"]["rows"]["lockstep"]["p50_s"]
        lines.append(f"| report() p50 <= {REPORT_P50_GOAL_S * 1e3:.0f} ms | {p50 * 1e3:.3f} ms | "
                     f"{_verdict(summary['report']['goal_met'])} |")
    if ray:
        for section in ("e2e", "startup"):
            if "lockstep_over_ray" in summary.get(section, {}):
                lines.append(f"| {section}: lockstep / Ray Train (no goal) | {summary[section]['lockstep_over_ray']:.3f} | – |")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------


def default_data_dir() -> str:
    return os.environ.get("LOCKSTEP_DATA") or str((REPO.parent / "shared" / "data").resolve())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help="a fast check: 1 repeat, e2e on the first 10,000 training images")
    parser.add_argument("--only", nargs="+", choices=["e2e", "startup", "report"], default=["e2e", "startup", "report"],
                        help="sections to run (default: all)")
    parser.add_argument("--no-one-worker", action="store_true", help="skip the lockstep 1-worker e2e runs")
    parser.add_argument("--e2e-limit", type=int, default=None, help="e2e on the first N training images (default: all)")
    parser.add_argument("--report-calls", type=int, default=2000, help="timed report()/barrier calls per run (default 2000)")
    parser.add_argument("--data-dir", default=default_data_dir(), help="Fashion-MNIST root (torchvision layout)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    parser.add_argument("--work-dir", type=Path, default=None, help="run folders and logs (default: a new temp folder)")
    parser.add_argument("--keep-logs", action="store_true", help="do not remove the work folder at the end")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
        args.e2e_limit = args.e2e_limit or 10_000
    if args.repeats < 1 or args.report_calls < 1:
        parser.error("--repeats and --report-calls must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    info = machine()
    ray = importlib.util.find_spec("ray") is not None
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_jobs_", dir=args.work_dir))
    (work / "logs").mkdir()
    e2e_todo = variants(ray, one_worker=not args.no_one_worker)
    startup_todo = variants(ray, one_worker=False)
    report_todo = variants(False, one_worker=False)
    raw: dict[str, dict[str, list[RunResult]]] = {}
    try:
        if "e2e" in args.only:
            job_args = [f"--data-dir={args.data_dir}"] + ([f"--limit={args.e2e_limit}"] if args.e2e_limit else [])
            raw["e2e"] = measure("e2e", "mlp", job_args, e2e_todo, args, work, sample_rss=True)
        if "startup" in args.only:
            raw["startup"] = measure("startup", "noop", [], startup_todo, args, work, sample_rss=False)
        if "report" in args.only:
            raw["report"] = measure("report", "noop", [f"--calls={args.report_calls}"], report_todo, args, work,
                                    sample_rss=False)
    finally:
        if args.keep_logs:
            print(f"logs: {work / 'logs'}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(raw)
    labels = _labels(e2e_todo)
    print(markdown(summary, args, info, command, labels, ray))
    if args.json is not None:
        document = {
            "command": command, "machine": info, "ray_installed": ray,
            "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
            "goals": {"e2e_lockstep_over_torchrun_max": E2E_GOAL, "startup_lockstep_over_torchrun_max": STARTUP_GOAL,
                      "report_p50_max_s": REPORT_P50_GOAL_S},
            "rss_method": "sum of VmRSS over the process tree, sampled every 0.2 s",
            "summary": summary,
            "raw": {section: {key: [vars(result) for result in results] for key, results in runs.items()}
                    for section, runs in raw.items()},
        }
        args.json.write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
