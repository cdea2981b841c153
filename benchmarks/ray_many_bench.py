"""16 ranks SPREAD over a 4-raylet Ray cluster: lockstep's Ray executor against Ray Train 2.60.

What it measures
----------------
One ``ray.cluster_utils.Cluster`` on this machine, 4 raylets (a head and 3 nodes, 5 CPUs each),
is started once and shared by every run; each run is a fresh ``python`` process that joins it
(``RAY_ADDRESS``) and runs ``jobs/ddp_many_lockstep.py --num-workers 16 --spread`` (a DDP step on
a small model and a metrics-only ``report()`` per step, 20 steps): once on lockstep's Ray executor
(``--lockstep-on-ray``), once on Ray Train (``--ray``: the same script, imports swapped), in an
order that alternates from round to round. Per run: the time ``fit()`` took (``fit_s``, printed by
the job), the whole process (launch to exit) and rank 0's ``report()`` p50.

Goal (issue #22, point 3; fixed before measuring): **fit() time, lockstep / Ray Train, the median
of the paired per-round ratios, <= 0.40**, met only when its 95 % bootstrap interval lies wholly
below, on at least 5 rounds.

    .venv/bin/python benchmarks/ray_many_bench.py [--rounds 5] [--ranks 16] [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from jobrunner import JOBS, run_job
from machine import describe_machine, machine_line
from record import add_results_args, goals_markdown, ratio_goal, write_result

RAYLETS = 4
CPUS_PER_RAYLET = 5
GOAL = 0.40
JOB_TIMEOUT_S = 900
VARIANTS = {"lockstep": ("--lockstep-on-ray", "lockstep, Ray executor"), "ray_train": ("--ray", "Ray Train")}


def start_cluster() -> Any:
    """A head and RAYLETS - 1 more raylets on this machine, CPUS_PER_RAYLET logical CPUs each."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_RAYLET, "include_dashboard": False})
    for _ in range(RAYLETS - 1):
        cluster.add_node(num_cpus=CPUS_PER_RAYLET)
    cluster.wait_for_nodes()
    return cluster


def one_run(variant: str, ranks: int, steps: int, address: str, folder: Path, log_name: str) -> dict[str, Any]:
    env = {**os.environ, "RAY_ADDRESS": address}
    command = [
        sys.executable,
        str(JOBS / "ddp_many_lockstep.py"),
        f"--num-workers={ranks}",
        f"--steps={steps}",
        "--spread",
        f"--storage-path={folder / 'runs'}",
        VARIANTS[variant][0],
    ]
    result = run_job(command, env, folder / log_name, timeout_s=JOB_TIMEOUT_S, sample_rss=False)
    if "fit_s" not in result.data:
        raise SystemExit(f"ray_many_bench: {variant} printed no BENCH_JSON line; see {folder / log_name}")
    return {"wall_s": result.wall_s, "fit_s": result.data["fit_s"], "p50_s": statistics.median(result.data["report_s"])}


def summary_table(samples: dict[str, list[dict[str, Any]]], ranks: int) -> str:
    lines = [
        f"| {ranks} ranks SPREAD, {RAYLETS} raylets, median over {len(samples['lockstep'])} rounds "
        f"| {VARIANTS['lockstep'][1]} | {VARIANTS['ray_train'][1]} |",
        "|---|---:|---:|",
    ]
    for figure, label, scale, unit in (
        ("fit_s", "fit()", 1, " s"),
        ("wall_s", "whole process", 1, " s"),
        ("p50_s", "rank 0's report() p50", 1000, " ms"),
    ):
        cells = [
            f"{statistics.median(sample[figure] for sample in samples[name]) * scale:.1f}{unit}" for name in VARIANTS
        ]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5: the goal needs 5)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a check that it works: 4 ranks, 1 round, 5 steps")
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.rounds, args.steps = 4, 1, 5
    info = describe_machine()
    print(machine_line(info), flush=True)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    cluster = start_cluster()
    try:
        with tempfile.TemporaryDirectory(prefix="lockstep_ray_many_") as folder:
            for round_number in range(args.rounds):
                order = list(VARIANTS) if round_number % 2 == 0 else list(reversed(VARIANTS))
                for name in order:
                    sample = one_run(
                        name, args.ranks, args.steps, cluster.address, Path(folder), f"{name}_{round_number}.log"
                    )
                    samples[name].append(sample)
                    print(
                        f"round {round_number + 1} {name}: fit {sample['fit_s']:.1f} s, "
                        f"whole {sample['wall_s']:.1f} s, "
                        f"report p50 {sample['p50_s'] * 1000:.1f} ms",
                        flush=True,
                    )
    finally:
        cluster.shutdown()
    goal = ratio_goal(
        f"{args.ranks} ranks SPREAD on {RAYLETS} raylets, fit(), lockstep (Ray executor) / Ray Train",
        [sample["fit_s"] for sample in samples["lockstep"]],
        [sample["fit_s"] for sample in samples["ray_train"]],
        GOAL,
    )
    text = f"Ray {ray.__version__}\n\n" + summary_table(samples, args.ranks) + "\n\n" + goals_markdown([goal])
    print(text)
    command = "python benchmarks/ray_many_bench.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    path = write_result(
        args.results_dir,
        "ray-many",
        command,
        info,
        args.quick,
        {"ray": ray.__version__, "samples": samples, "config": vars(args) | {"results_dir": str(args.results_dir)}},
        [goal],
        text,
    )
    if path is not None:
        print(f"results: {path}")


if __name__ == "__main__":
    main()
