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
* Both lockstep jobs import torch (the e2e job also torchvision) before lockstep, as users write
  scripts (round 3; earlier results imported lockstep first), and each runs three ways: ``python
  job.py``; ``lockstep run job.py`` (the launcher, which starts the warm worker process before
  the script's first line); and ``python job.py`` with lockstep's start hook installed in this
  venv (``lockstep start-hook install``: the same early start from a .pth file; installed just
  before each of that variant's runs and removed just after, so no other run has it). Each way
  is judged against the same goals.
* **report**: the same no-op scripts with ``--calls 2000``: rank 0's time per metrics-only
  ``report()`` (lockstep), and per ``dist.barrier()`` (torchrun; not the same operation, shown
  only as the floor of a collective). p50 / p99 over the 2000 calls of each run (after 50 untimed
  warm-up calls), then the median over repeats. Ray Train's ``report()`` is measured in the same
  rounds (``--ray-report-calls``, default 3 after 1 untimed: each takes about 2 s).
* **refit**: ``jobs/refit_lockstep.py`` calls a no-op ``fit()`` (2 workers) ``--refits`` times in
  one driver process and prints each call's wall time; ``python -c "import torch"`` is timed as
  a fresh process in the same round.
* **peak RSS**: during every e2e run a thread of this script sums ``VmRSS`` (from
  ``/proc/<pid>/status``) over the launched process and all its descendants every 0.2 s and keeps
  the largest sum. Limits: a peak shorter than 0.2 s can be missed, and RSS counts pages shared
  between processes (torch's libraries, the page cache of mapped files) once per process, so the
  sum overstates the memory really used; it is the same yardstick for both launchers.

If ``ray`` is importable (and ``--no-ray`` is not given), the e2e, startup and report jobs also
run on Ray Train (the lockstep scripts with ``--ray``, which only swaps the imports; each run
starts its own Ray cluster, as a new user's script would); else the tables say "not installed".

Runs are interleaved: each round runs every variant once (lockstep, torchrun, [Ray], lockstep
1 worker), the order rotated by one from one round to the next. Goals (issue #14), each judged by
a statistic fixed here before measuring:

* seed 003's job, lockstep / torchrun + DDP <= 0.90 (stretch 0.85), and lockstep / Ray Train
  <= 0.40; the no-op job, lockstep / torchrun <= 0.70: the median of the paired per-round ratios
  (both runs of a pair in the same round), with a bootstrap 95% interval;
* a later no-op ``fit()`` / ``python -c "import torch"`` <= 0.25: per round, the median of the
  fits after the first in one driver over the import timed in that round; median over rounds;
* ``report()`` p50 <= 1 ms: the median over runs of each run's p50.

With ``--results-dir DIR`` the raw samples, machine, commit and command go to a results file
(benchmarks/record.py); benchmarks/tables.py writes the README tables from it.

How to run
----------
From the repository root, with the project's venv::

    .venv/bin/python benchmarks/bench_jobs.py --no-one-worker       # about 12 minutes on 2 CPUs
    .venv/bin/python benchmarks/bench_jobs.py --quick               # a check: 1 round, small counts
    .venv/bin/python benchmarks/bench_jobs.py --only startup report --json out.json

The data is read from ``--data-dir`` (default ``$LOCKSTEP_DATA``, else ``../shared/data`` next to
the repository). Run folders and logs go to ``--work-dir`` (default: a new temporary folder,
removed at the end). Every process a run leaves behind (there should be none) is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobrunner import JOBS, REPO, RunResult, Variant, job_command, run_job  # noqa: E402 - script folder
from machine import describe_machine, machine_line  # noqa: E402
from record import (  # noqa: E402
    Goal,
    add_results_args,
    bootstrap_ci,
    goals_markdown,
    paired_ratios,
    ratio_goal,
    write_result,
)

from lockstep._internal import start_hook  # noqa: E402

#: The variant run with lockstep's start hook installed in this venv (for its runs only).
HOOKED = "lockstep_hook"

MIB = 1024 * 1024
# The goals of issue #14; each is judged by the statistic named in summarize() (see the docstring).
E2E_GOAL = 0.90  # seed 003's job, whole process, lockstep / torchrun + hand-written DDP
E2E_STRETCH = 0.85
STARTUP_GOAL = 0.70  # the no-op job, lockstep / torchrun
E2E_RAY_GOAL = 0.40  # seed 003's job, lockstep / Ray Train (each starting its own cluster)
REFIT_GOAL = 0.25  # a later no-op fit() in one driver / python -c "import torch", same round
REPORT_P50_GOAL_S = 0.001


# -- the measurements --------------------------------------------------------------------------


def variants(ray: bool, one_worker: bool, torchrun: bool = True, launcher: bool = False) -> list[Variant]:
    found = [Variant("lockstep", "lockstep (python job.py)", "lockstep")]
    if launcher:
        found.append(Variant("lockstep_run", "lockstep run job.py", "lockstep_run"))
        found.append(Variant(HOOKED, "lockstep (python job.py, start hook installed)", "lockstep"))
    if torchrun:
        found.append(Variant("torchrun", "torchrun + DDP", "torchrun"))
    if ray:
        found.append(Variant("ray", "Ray Train", "ray"))
    if one_worker:
        found.append(Variant("lockstep_1w", "lockstep, 1 worker", "lockstep", workers=1))
    return found


REFIT_VARIANTS = [
    Variant("import_torch", 'python -c "import torch"', "plain"),
    Variant("refit", "lockstep, fit() after fit() in one process", "lockstep"),
]


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


def refit_command(variant: Variant, args: argparse.Namespace, storage: Path) -> tuple[list[str], dict[str, str]]:
    """``python -c "import torch"``, or the driver that calls fit() ``--refits`` times."""
    if variant.key == "import_torch":
        return [sys.executable, "-c", "import torch"], dict(os.environ)
    return (
        [
            sys.executable,
            str(JOBS / "refit_lockstep.py"),
            "--num-workers=2",
            f"--fits={args.refits}",
            f"--storage-path={storage}",
        ],
        dict(os.environ),
    )


def measure(
    section: str,
    job: str,
    job_args: dict[str, list[str]],
    todo: list[Variant],
    args: argparse.Namespace,
    work: Path,
    sample_rss: bool,
) -> dict[str, list[RunResult]]:
    """``args.repeats`` interleaved runs of every variant of one section (``job_args`` per variant)."""
    runs: dict[str, list[RunResult]] = {variant.key: [] for variant in todo}
    for repeat in range(args.repeats):
        for variant in rotated(todo, repeat):
            if section == "refit":
                command, env = refit_command(variant, args, work / "runs")
            else:
                command, env = job_command(variant, job, job_args[variant.key], work / "runs")
            log = work / "logs" / f"{section}_{variant.key}_{repeat}.log"
            with start_hook_for(variant):
                result = run_job(command, env, log, args.timeout, sample_rss)
            runs[variant.key].append(result)
            detail = ""
            if result.peak_rss is not None:
                detail += f", peak RSS {result.peak_rss / MIB:.0f} MiB"
            for name, values in result.data.items():
                detail += f", {name} p50 {percentile(values, 50) * 1e3:.3f} ms"
            print(
                f"[{section} {repeat + 1}/{args.repeats}] {variant.label}: {result.wall_s:.2f} s{detail}",
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(work / "runs", ignore_errors=True)
    return runs


#: How the lockstep job is started: the variant's key, and its name in the goals.
LOCKSTEP_LAUNCHES = {
    "lockstep": "lockstep (python job.py)",
    "lockstep_run": "lockstep run job.py",
    HOOKED: "python job.py with the start hook",
}


@contextlib.contextmanager
def start_hook_for(variant: Variant) -> Iterator[None]:
    """The start hook installed in this venv for the runs of the variant ``lockstep_hook`` only."""
    if variant.key != HOOKED:
        yield
        return
    start_hook.install()
    try:
        yield
    finally:
        start_hook.remove()


def launch_goals(
    section: str, key: str, how: str, runs: dict[str, list[RunResult]], summary: dict[str, Any]
) -> list[Goal]:
    """The goals of one way of starting lockstep's job (``key``) against torchrun and Ray Train;
    the ratios also go into ``summary`` (``<key>_over_torchrun``, ``<key>_over_ray``)."""
    job = "seed 003's job" if section == "e2e" else "no-op job"
    goal = ratio_goal(
        f"{job}, {how} / torchrun + DDP",
        walls(runs[key]),
        walls(runs["torchrun"]),
        E2E_GOAL if section == "e2e" else STARTUP_GOAL,
    )
    goals = [goal]
    summary[f"{key}_over_torchrun"] = goal.value
    if section == "e2e":
        goals.append(
            Goal(f"{job}, {how} / torchrun + DDP (stretch)", goal.statistic, goal.value, E2E_STRETCH, ci95=goal.ci95)
        )
    if "ray" in runs:
        ray_goal = ratio_goal(
            f"{job}, {how} / Ray Train",
            walls(runs[key]),
            walls(runs["ray"]),
            E2E_RAY_GOAL if section == "e2e" else float("inf"),
        )
        summary[f"{key}_over_ray"] = ray_goal.value
        if section == "e2e":
            goals.append(ray_goal)
    return goals


def wall_stats(results: list[RunResult]) -> dict[str, Any]:
    walls = [result.wall_s for result in results]
    return {"median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls), "runs_s": walls}


def walls(results: list[RunResult]) -> list[float]:
    """Whole-process wall times, one per repeat (in repeat order)."""
    return [result.wall_s for result in results]


def later_fits(result: RunResult) -> float:
    """Median wall time of the fit() calls after the first one, in one refit driver."""
    return statistics.median(result.data["fit_s"][1:])


def summarize(raw: dict[str, dict[str, list[RunResult]]]) -> tuple[dict[str, Any], list[Goal]]:
    """Medians, paired ratios and the goals (see the module docstring for each goal's statistic)."""
    summary: dict[str, Any] = {}
    goals: list[Goal] = []
    for section in ("e2e", "startup"):
        if section not in raw:
            continue
        runs = raw[section]
        summary[section] = {"rows": {key: wall_stats(results) for key, results in runs.items()}}
        for key, how in LOCKSTEP_LAUNCHES.items():
            if key in runs:
                goals += launch_goals(section, key, how, runs, summary[section])
        if section == "e2e":
            summary[section]["rss"] = {
                key: {
                    "peak_total_median_bytes": statistics.median(r.peak_rss or 0 for r in results),
                    "peak_root_median_bytes": statistics.median(r.peak_root_rss or 0 for r in results),
                    "processes": max(r.peak_processes or 0 for r in results),
                }
                for key, results in runs.items()
            }
            if "lockstep_1w" in runs:
                summary[section]["two_over_one_worker"] = statistics.median(
                    paired_ratios(walls(runs["lockstep"]), walls(runs["lockstep_1w"]))
                )
    if "report" in raw:
        rows = {}
        for key, results in raw["report"].items():
            name = "barrier_s" if key == "torchrun" else "report_s"
            rows[key] = {
                "op": "dist.barrier()" if key == "torchrun" else "report()",
                "calls": len(results[0].data[name]),
                "p50_runs_s": [percentile(r.data[name], 50) for r in results],
                "p50_s": statistics.median(percentile(r.data[name], 50) for r in results),
                "p99_s": statistics.median(percentile(r.data[name], 99) for r in results),
                "max_s": max(max(r.data[name]) for r in results),
            }
        p50s = [value * 1e3 for value in rows["lockstep"]["p50_runs_s"]]
        goals.append(
            Goal(
                "lockstep report() p50",
                f"median over {len(p50s)} runs of each run's p50 ({rows['lockstep']['calls']} calls per run, rank 0)",
                statistics.median(p50s),
                REPORT_P50_GOAL_S * 1e3,
                unit="ms",
                ci95=bootstrap_ci(p50s),
            )
        )
        summary["report"] = {"rows": rows}
    if "refit" in raw:
        runs = raw["refit"]
        later = [later_fits(result) for result in runs["refit"]]
        goal = ratio_goal(
            'a later no-op fit() (2 workers) / python -c "import torch"', later, walls(runs["import_torch"]), REFIT_GOAL
        )
        goals.append(
            Goal(
                goal.name,
                goal.statistic + " (each round: the median of the fits after the first in "
                "one driver, over the import measured in the same round)",
                goal.value,
                goal.limit,
                ci95=goal.ci95,
            )
        )
        summary["refit"] = {
            "import_torch": wall_stats(runs["import_torch"]),
            "fits_s": [result.data["fit_s"] for result in runs["refit"]],
            "later_fit_median_s": statistics.median(later),
            "ratio": goal.value,
        }
    return summary, goals


# -- output ------------------------------------------------------------------------------------


def markdown(
    summary: dict[str, Any],
    goals: list[Goal],
    args: argparse.Namespace,
    info: dict[str, str],
    command: str,
    labels: dict[str, str],
    ray: bool,
) -> str:
    """The results as markdown tables, with the machine and the command."""
    images = f"first {args.e2e_limit:,} training images" if args.e2e_limit else "60,000 training images"
    lines = [
        machine_line(info),
        f"Command: `{command}`",
        f"{args.repeats} interleaved round(s); whole-process wall time (launch to exit); 2 workers "
        f"unless said"
        + (f"; e2e = seed 003's MLP job, {images}, 1 epoch + validation on 10,000." if "e2e" in summary else "."),
        "Ray Train: installed, measured." if ray else "Ray Train: not installed, not measured.",
        "",
    ]
    if "e2e" in summary or "startup" in summary:
        lines += ["| job | launcher | wall median (s) | min (s) | max (s) |", "|---|---|---:|---:|---:|"]
        for section in ("e2e", "startup"):
            for key, row in summary.get(section, {}).get("rows", {}).items():
                lines.append(
                    f"| {section} | {labels[key]} | {row['median_s']:.2f} | {row['min_s']:.2f} | {row['max_s']:.2f} |"
                )
        lines.append("")
    if "e2e" in summary:
        e2e = summary["e2e"]
        if "two_over_one_worker" in e2e:
            lines += [
                f"lockstep e2e, 2 workers / 1 worker (batch 64), median of paired rounds: "
                f"{e2e['two_over_one_worker']:.2f}",
                "",
            ]
        lines += [
            "| e2e peak RSS (sampled every 0.2 s) | driver + workers, sum (MiB) "
            "| driver / launcher alone (MiB) | processes |",
            "|---|---:|---:|---:|",
        ]
        for key, row in e2e["rss"].items():
            lines.append(
                f"| {labels[key]} | {row['peak_total_median_bytes'] / MIB:.0f} | "
                f"{row['peak_root_median_bytes'] / MIB:.0f} | {row['processes']} |"
            )
        lines.append("")
    if "report" in summary:
        lines += [
            "| metrics-only calls, rank 0, 2 workers | operation | calls per run | p50 (ms) | p99 (ms) | max (ms) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for key, row in summary["report"]["rows"].items():
            note = " (for comparison, not a report)" if key == "torchrun" else ""
            lines.append(
                f"| {labels[key]} | {row['op']}{note} | {row['calls']} | {row['p50_s'] * 1e3:.3f} | "
                f"{row['p99_s'] * 1e3:.3f} | {row['max_s'] * 1e3:.2f} |"
            )
        lines.append("")
    if "refit" in summary:
        refit = summary["refit"]
        fits = "; ".join(", ".join(f"{value:.2f}" for value in run) for run in refit["fits_s"])
        lines += [
            f'`python -c "import torch"`: median {refit["import_torch"]["median_s"]:.2f} s; '
            f"no-op fit() calls in one driver, per round (s): {fits}; later fits, median "
            f"{refit['later_fit_median_s']:.2f} s.",
            "",
        ]
    lines.append(goals_markdown(goals))
    return "\n".join(lines)


def headline(summary: dict[str, Any]) -> list[dict[str, str]]:
    """Rows for the top-level README's performance table."""
    rows: list[dict[str, str]] = []
    for key, how in LOCKSTEP_LAUNCHES.items():
        if key in summary.get("e2e", {}).get("rows", {}):
            e2e = summary["e2e"]["rows"]
            rows.append(
                {
                    "what": f"seed 003's job, 1 epoch, whole process, {how}",
                    "lockstep": f"{e2e[key]['median_s']:.2f} s",
                    "compared_with": f"torchrun + hand-written DDP {e2e['torchrun']['median_s']:.2f} s",
                    "ratio": f"{summary['e2e'][f'{key}_over_torchrun']:.3f} (goal <= {E2E_GOAL})",
                }
            )
            if "ray" in e2e:
                rows.append(
                    {
                        "what": f"seed 003's job, whole process, {how}",
                        "lockstep": f"{e2e[key]['median_s']:.2f} s",
                        "compared_with": f"Ray Train {e2e['ray']['median_s']:.2f} s",
                        "ratio": f"{summary['e2e'][f'{key}_over_ray']:.3f} (goal <= {E2E_RAY_GOAL})",
                    }
                )
        if key in summary.get("startup", {}).get("rows", {}):
            startup = summary["startup"]["rows"]
            rows.append(
                {
                    "what": f"no-op job (start-up + shut-down), {how}",
                    "lockstep": f"{startup[key]['median_s']:.2f} s",
                    "compared_with": f"torchrun {startup['torchrun']['median_s']:.2f} s",
                    "ratio": f"{summary['startup'][f'{key}_over_torchrun']:.3f} (goal <= {STARTUP_GOAL})",
                }
            )
    if "refit" in summary:
        refit = summary["refit"]
        rows.append(
            {
                "what": "a later no-op fit() in the same process",
                "lockstep": f"{refit['later_fit_median_s']:.2f} s",
                "compared_with": f'python -c "import torch" {refit["import_torch"]["median_s"]:.2f} s',
                "ratio": f"{refit['ratio']:.3f} (goal <= {REFIT_GOAL})",
            }
        )
    if "report" in summary:
        report = summary["report"]["rows"]
        other = f"Ray Train {report['ray']['p50_s'] * 1e3:,.1f} ms" if "ray" in report else "Ray Train: not measured"
        rows.append(
            {
                "what": "metrics-only report(), p50",
                "lockstep": f"{report['lockstep']['p50_s'] * 1e3:.3f} ms",
                "compared_with": other,
                "ratio": f"(goal <= {REPORT_P50_GOAL_S * 1e3:.0f} ms)",
            }
        )
    return rows


# -- main --------------------------------------------------------------------------------------


def default_data_dir() -> str:
    return os.environ.get("LOCKSTEP_DATA") or str((REPO.parent / "shared" / "data").resolve())


SECTIONS = ["e2e", "startup", "report", "refit"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--repeats", type=int, default=5, help="interleaved rounds per section (default 5: goals need 5)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a check that it works, not a measurement: 1 round, e2e on the first 10,000 "
        "training images, 200 report calls, 3 fits, no 1-worker runs; results marked quick",
    )
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="sections to run (default: all)")
    parser.add_argument("--no-one-worker", action="store_true", help="skip the lockstep 1-worker e2e runs")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray Train even when it is installed")
    parser.add_argument("--e2e-limit", type=int, default=None, help="e2e on the first N training images (default: all)")
    parser.add_argument(
        "--report-calls", type=int, default=2000, help="timed report()/barrier calls per run (default 2000)"
    )
    parser.add_argument(
        "--ray-report-calls",
        type=int,
        default=3,
        help="timed report() calls per Ray Train run (default 3: each takes about 2 s)",
    )
    parser.add_argument("--refits", type=int, default=4, help="no-op fit() calls in one refit driver (default 4)")
    parser.add_argument("--data-dir", default=default_data_dir(), help="Fashion-MNIST root (torchvision layout)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    parser.add_argument("--work-dir", type=Path, default=None, help="run folders and logs (default: a new temp folder)")
    parser.add_argument("--keep-logs", action="store_true", help="do not remove the work folder at the end")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
        args.e2e_limit = args.e2e_limit or 10_000
        args.report_calls = min(args.report_calls, 200)
        args.refits = min(args.refits, 3)
        args.no_one_worker = True
    if args.repeats < 1 or args.report_calls < 1 or args.ray_report_calls < 1 or args.refits < 2:
        parser.error("--repeats, --report-calls and --ray-report-calls must be >= 1, --refits >= 2")
    return args


def run_sections(args: argparse.Namespace, ray: bool, work: Path) -> dict[str, dict[str, list[RunResult]]]:
    """Every section asked for, one after the other."""
    raw: dict[str, dict[str, list[RunResult]]] = {}
    if "e2e" in args.only:
        job_args = [f"--data-dir={args.data_dir}"] + ([f"--limit={args.e2e_limit}"] if args.e2e_limit else [])
        todo = variants(ray, one_worker=not args.no_one_worker, launcher=True)
        raw["e2e"] = measure("e2e", "mlp", {v.key: job_args for v in todo}, todo, args, work, sample_rss=True)
    if "startup" in args.only:
        todo = variants(ray, one_worker=False, launcher=True)
        raw["startup"] = measure("startup", "noop", {v.key: [] for v in todo}, todo, args, work, sample_rss=False)
    if "report" in args.only:
        todo = variants(ray, one_worker=False)
        calls = {
            "lockstep": [f"--calls={args.report_calls}"],
            "torchrun": [f"--calls={args.report_calls}"],
            "ray": [f"--calls={args.ray_report_calls}", "--warmup=1"],
        }
        raw["report"] = measure("report", "noop", calls, todo, args, work, sample_rss=False)
    if "refit" in args.only:
        raw["refit"] = measure("refit", "", {}, REFIT_VARIANTS, args, work, sample_rss=False)
    return raw


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if start_hook.hook_state() != "absent":
        sys.exit(
            f"lockstep's start hook is installed in this venv ({start_hook.hook_path()}): every variant would run "
            "with it; remove it first (lockstep start-hook remove)"
        )
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    info = describe_machine()
    ray = importlib.util.find_spec("ray") is not None and not args.no_ray
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_jobs_", dir=args.work_dir))
    (work / "logs").mkdir()
    try:
        raw = run_sections(args, ray, work)
    finally:
        if args.keep_logs:
            print(f"logs: {work / 'logs'}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    summary, goals = summarize(raw)
    labels = {variant.key: variant.label for variant in variants(True, True, launcher=True) + REFIT_VARIANTS}
    text = markdown(summary, goals, args, info, command, labels, ray)
    print(text)
    document = {
        "ray_installed": ray,
        "partial": set(args.only) != set(SECTIONS) or not ray,
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "rss_method": "sum of VmRSS over the process tree, sampled every 0.2 s",
        "summary": summary,
        "raw": {
            section: {key: [vars(result) for result in results] for key, results in runs.items()}
            for section, runs in raw.items()
        },
    }
    path = write_result(args.results_dir, "jobs", command, info, args.quick, document, goals, text, headline(summary))
    if path is not None:
        print(f"results: {path}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"command": command, "machine": info, "goals": [g.as_dict() for g in goals], **document}, indent=1
            )
        )


if __name__ == "__main__":
    main()
