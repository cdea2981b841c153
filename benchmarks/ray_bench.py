"""lockstep's Ray executor vs Ray Train on the same Ray cluster: seed 003's job, and report().

What it measures
----------------
This script starts one local Ray cluster (``ray.init(num_cpus=3)``: 2 workers plus the CPU Ray
Train's controller asks for) and every run joins it as a new driver (``RAY_ADDRESS``), so the
cluster's own start-up is not counted; each run is a fresh ``python`` process, timed from launch
to exit (whole process: imports, ``ray.init`` connect, workers, training, shut-down).

* **e2e**: ``jobs/mlp_lockstep.py`` (seed 003's job: MLP, SGD lr 1e-3, global batch 64, the
  60,000 training images in order, 1 epoch, validation on 10,000), 2 CPU workers, run as
  ``--lockstep-on-ray`` (lockstep, Ray executor) and ``--ray`` (Ray Train, same code, imports
  swapped); also on lockstep's local executor, without Ray, for reference.
* **report()**: ``jobs/noop_lockstep.py --calls N``: rank 0's time per metrics-only
  ``report()``, p50 / p99, median over repeats. Ray Train's report takes about 2 s (it waits for
  its controller's poll), so it gets far fewer calls.

Runs are interleaved (each repeat runs every variant once, order rotated). Ray's version is
printed with the table.

How to run
----------
From the repository root, with the project's venv (Ray installed: ``pip install 'ray[train]'``)::

    .venv/bin/python benchmarks/ray_bench.py                  # about 12 minutes on 2 CPUs
    .venv/bin/python benchmarks/ray_bench.py --quick          # 1 repeat, e2e on 10k images
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_jobs import JOBS, default_data_dir, percentile, rotated, run_job  # noqa: E402 - script folder
from machine import describe_machine, machine_line  # noqa: E402
from record import add_results_args, bootstrap_ci, paired_ratios, write_result  # noqa: E402

CLUSTER_CPUS = 3


@dataclass(frozen=True)
class RayVariant:
    key: str
    label: str
    flags: tuple[str, ...]
    on_cluster: bool = True


E2E_VARIANTS = [
    RayVariant("lockstep_ray", "lockstep, Ray executor", ("--lockstep-on-ray",)),
    RayVariant("ray_train", "Ray Train", ("--ray",)),
    RayVariant("lockstep_local", "lockstep, local executor (no Ray)", (), on_cluster=False),
]
REPORT_VARIANTS = E2E_VARIANTS[:2]


def command_for(
    variant: RayVariant, job: str, job_args: list[str], storage: Path, address: str
) -> tuple[list[str], dict[str, str]]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    if variant.on_cluster:
        env["RAY_ADDRESS"] = address
    command = [
        sys.executable,
        str(JOBS / f"{job}_lockstep.py"),
        "--num-workers=2",
        f"--storage-path={storage}",
        *variant.flags,
        *job_args,
    ]
    return command, env


def measure(
    section: str,
    job: str,
    per_variant_args: dict[str, list[str]],
    todo: list[RayVariant],
    args: argparse.Namespace,
    work: Path,
    address: str,
) -> dict[str, list[Any]]:
    runs: dict[str, list[Any]] = {variant.key: [] for variant in todo}
    for repeat in range(args.repeats):
        for variant in rotated(todo, repeat):
            command, env = command_for(variant, job, per_variant_args[variant.key], work / "runs", address)
            result = run_job(command, env, work / "logs" / f"{section}_{variant.key}_{repeat}.log", args.timeout, False)
            runs[variant.key].append(result)
            detail = "".join(
                f", {name} p50 {percentile(values, 50) * 1e3:.2f} ms" for name, values in result.data.items()
            )
            print(
                f"[{section} {repeat + 1}/{args.repeats}] {variant.label}: {result.wall_s:.2f} s{detail}",
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(work / "runs", ignore_errors=True)
    return runs


def summarize(raw: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    if "e2e" in raw:
        rows = {}
        for key, results in raw["e2e"].items():
            walls = [result.wall_s for result in results]
            rows[key] = {
                "median_s": statistics.median(walls),
                "min_s": min(walls),
                "max_s": max(walls),
                "runs_s": walls,
            }
        ratios = paired_ratios(rows["lockstep_ray"]["runs_s"], rows["ray_train"]["runs_s"])
        summary["e2e"] = {
            "rows": rows,
            "lockstep_ray_over_ray_train": statistics.median(ratios),
            "ci95": bootstrap_ci(ratios),
        }
    if "report" in raw:
        summary["report"] = {
            key: {
                "calls": len(results[0].data["report_s"]),
                "p50_s": statistics.median(percentile(result.data["report_s"], 50) for result in results),
                "p99_s": statistics.median(percentile(result.data["report_s"], 99) for result in results),
            }
            for key, results in raw["report"].items()
        }
    return summary


def markdown(
    summary: dict[str, Any], args: argparse.Namespace, info: dict[str, str], ray_version: str, command: str
) -> str:
    labels = {variant.key: variant.label for variant in E2E_VARIANTS}
    images = f"first {args.e2e_limit:,} training images" if args.e2e_limit else "60,000 training images"
    lines = [
        machine_line(info),
        f"Command: `{command}`",
        f"One local Ray cluster ({CLUSTER_CPUS} CPUs) shared by every run; "
        f"{args.repeats} interleaved repeat(s), medians; "
        f"whole process (launch to exit); 2 workers; e2e = seed 003's MLP job, {images}, 1 epoch + validation.",
        "",
    ]
    if "e2e" in summary:
        lines += ["| e2e | wall median (s) | min (s) | max (s) |", "|---|---:|---:|---:|"]
        for key, row in summary["e2e"]["rows"].items():
            lines.append(f"| {labels[key]} | {row['median_s']:.2f} | {row['min_s']:.2f} | {row['max_s']:.2f} |")
        low, high = summary["e2e"]["ci95"]
        lines += [
            f"| lockstep (Ray executor) / Ray Train, median of paired per-round ratios (95% CI {low:.3f} – {high:.3f}; "
            f"no goal) | {summary['e2e']['lockstep_ray_over_ray_train']:.3f} | | |",
            "",
        ]
    if "report" in summary:
        lines += ["| metrics-only report(), rank 0 | calls per run | p50 (ms) | p99 (ms) |", "|---|---:|---:|---:|"]
        for key, row in summary["report"].items():
            lines.append(f"| {labels[key]} | {row['calls']} | {row['p50_s'] * 1e3:.2f} | {row['p99_s'] * 1e3:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs per variant (default 5: goals need 5)")
    parser.add_argument("--quick", action="store_true", help="1 repeat, e2e on the first 10,000 training images")
    parser.add_argument("--only", nargs="+", choices=["e2e", "report"], default=["e2e", "report"])
    parser.add_argument("--e2e-limit", type=int, default=None, help="e2e on the first N training images (default: all)")
    parser.add_argument("--report-calls", type=int, default=500, help="timed report() calls, lockstep (default 500)")
    parser.add_argument(
        "--ray-train-report-calls", type=int, default=5, help="timed report() calls, Ray Train (default 5)"
    )
    parser.add_argument("--data-dir", default=default_data_dir(), help="Fashion-MNIST root (torchvision layout)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
        args.e2e_limit = args.e2e_limit or 10_000
    return args


def main(argv: list[str] | None = None) -> None:
    import ray

    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    info = describe_machine()
    work = Path(tempfile.mkdtemp(prefix="ray_bench_"))
    (work / "logs").mkdir()
    # address='local': always a new cluster of our own, even when another one runs on this machine
    cluster = ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False)
    address = cluster.address_info["address"]
    raw: dict[str, dict[str, list[Any]]] = {}
    try:
        if "e2e" in args.only:
            job_args = [f"--data-dir={args.data_dir}"] + ([f"--limit={args.e2e_limit}"] if args.e2e_limit else [])
            raw["e2e"] = measure(
                "e2e", "mlp", {variant.key: job_args for variant in E2E_VARIANTS}, E2E_VARIANTS, args, work, address
            )
        if "report" in args.only:
            calls = {
                "lockstep_ray": [f"--calls={args.report_calls}", "--warmup=20"],
                "ray_train": [f"--calls={args.ray_train_report_calls}", "--warmup=1"],
            }
            raw["report"] = measure("report", "noop", calls, REPORT_VARIANTS, args, work, address)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(raw)
    text = markdown(summary, args, info, ray.__version__, command)
    print(text)
    document = {
        "ray": ray.__version__,
        "summary": summary,
        "partial": set(args.only) != {"e2e", "report"},
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "raw": {
            section: {key: [vars(result) for result in results] for key, results in runs.items()}
            for section, runs in raw.items()
        },
    }
    path = write_result(args.results_dir, "ray", command, info, args.quick, document, [], text, headline(summary))
    if path is not None:
        print(f"results: {path}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps({"command": command, "machine": info, **document}, indent=1))


def headline(summary: dict[str, Any]) -> list[dict[str, str]]:
    """Rows for the top-level README's performance table."""
    rows = []
    if "e2e" in summary:
        e2e = summary["e2e"]
        rows.append(
            {
                "what": "seed 003's job on one Ray cluster, whole process",
                "lockstep": f"{e2e['rows']['lockstep_ray']['median_s']:.2f} s (Ray executor)",
                "compared_with": f"Ray Train {e2e['rows']['ray_train']['median_s']:.2f} s",
                "ratio": f"{e2e['lockstep_ray_over_ray_train']:.3f}",
            }
        )
    if "report" in summary:
        report = summary["report"]
        rows.append(
            {
                "what": "metrics-only report() on one Ray cluster, p50",
                "lockstep": f"{report['lockstep_ray']['p50_s'] * 1e3:.3f} ms (Ray executor)",
                "compared_with": f"Ray Train {report['ray_train']['p50_s'] * 1e3:,.1f} ms",
                "ratio": "",
            }
        )
    return rows


if __name__ == "__main__":
    main()
