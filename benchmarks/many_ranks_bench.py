"""Many real ranks on one machine: lockstep vs torchrun + hand-written DDP at 32 ranks (and more).

Each round runs ``jobs/ddp_many_lockstep.py`` (``ScalingConfig(num_workers=N)``: a DDP step on a
small model and a metrics-only ``report()`` per step, 20 steps) and ``jobs/ddp_many_torchrun.py``
(the same under ``python -m torch.distributed.run --nproc_per_node=N``, with ``dist.barrier()``
for the report, ``OMP_NUM_THREADS=1`` as lockstep's workers get), each as a fresh process timed
from launch to exit, in an order that alternates from round to round. It measures:

* the whole process (wall time);
* rank 0's ``report()`` p50 over the job's steps, against rank 0's ``dist.barrier()`` p50 in the
  hand-written job (the floor of any collective on this machine);
* the summed memory of the job's processes: every 0.5 s the PSS of every process of the job's
  tree (``/proc/<pid>/smaps_rollup``; pages shared by several processes counted once in all),
  summed; the peak of the sums.

Goals (issue #22, fixed before measuring), at 32 ranks, each the median of the paired per-round
ratios (lockstep over torchrun) with a 95 % bootstrap interval, met only when the whole interval is
on the right side, on at least 5 rounds: whole process <= 0.35; ``report()`` p50 / barrier p50
<= 1.5; peak summed PSS <= 0.5.

    python benchmarks/many_ranks_bench.py --ranks 32 --rounds 5 --results-dir benchmarks/results
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

from jobrunner import JOBS, free_port, run_job
from machine import describe_machine, machine_line
from record import Goal, add_results_args, goals_markdown, ratio_goal, write_result

GOALS = (  # (figure, limit, what) fixed before measuring
    ("wall_s", 0.35, "whole process"),
    ("p50_s", 1.5, "rank 0's report() p50 / dist.barrier() p50"),
    ("peak_pss", 0.5, "peak summed PSS of the job's processes"),
)
JOB_TIMEOUT_S = 900


def lockstep_command(ranks: int, steps: int, storage: Path) -> list[str]:
    return [
        sys.executable,
        str(JOBS / "ddp_many_lockstep.py"),
        f"--num-workers={ranks}",
        f"--steps={steps}",
        f"--storage-path={storage}",
    ]


def torchrun_command(ranks: int, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        str(JOBS / "ddp_many_torchrun.py"),
        f"--steps={steps}",
    ]


def one_run(name: str, ranks: int, steps: int, folder: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = lockstep_command(ranks, steps, folder / "runs") if name == "lockstep" else torchrun_command(ranks, steps)
    result = run_job(command, env, folder / f"{name}.log", timeout_s=JOB_TIMEOUT_S, sample_rss=False, sample_pss=True)
    times = result.data["report_s" if name == "lockstep" else "barrier_s"]
    return {"wall_s": result.wall_s, "p50_s": statistics.median(times), "peak_pss": result.peak_pss, "times_s": times}


def judge(samples: dict[str, list[dict[str, Any]]], ranks: int) -> list[Goal]:
    goals = []
    for figure, limit, what in GOALS:
        goal = ratio_goal(
            f"{ranks} ranks, {what}, lockstep / torchrun + DDP",
            [sample[figure] for sample in samples["lockstep"]],
            [sample[figure] for sample in samples["torchrun"]],
            limit,
        )
        goals.append(goal)
    return goals


def summary_table(samples: dict[str, list[dict[str, Any]]], ranks: int) -> str:
    lines = [
        f"| {ranks} ranks, median over {len(samples['lockstep'])} rounds | lockstep | torchrun + DDP |",
        "|---|---:|---:|",
    ]
    for figure, label, scale, unit in (
        ("wall_s", "whole process", 1, " s"),
        ("p50_s", "rank 0's report / barrier p50", 1000, " ms"),
        ("peak_pss", "peak summed PSS", 2**-20, " MiB"),
    ):
        cells = [
            f"{statistics.median(sample[figure] for sample in samples[name]) * scale:.1f}{unit}"
            for name in ("lockstep", "torchrun")
        ]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="8 ranks, 1 round")
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.rounds = 8, 1
    info = describe_machine()
    print(machine_line(info), flush=True)
    samples: dict[str, list[dict[str, Any]]] = {"lockstep": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="lockstep_many_") as folder:
        for round_number in range(args.rounds):
            order = ["lockstep", "torchrun"] if round_number % 2 == 0 else ["torchrun", "lockstep"]
            for name in order:
                sample = one_run(name, args.ranks, args.steps, Path(folder))
                samples[name].append(sample)
                print(
                    f"round {round_number + 1} {name}: {sample['wall_s']:.1f} s, p50 {sample['p50_s'] * 1000:.1f} ms, "
                    f"PSS {sample['peak_pss'] / 2**20:.0f} MiB",
                    flush=True,
                )
    goals = judge(samples, args.ranks)
    table = summary_table(samples, args.ranks)
    print(table)
    print(goals_markdown(goals))
    command = "python benchmarks/many_ranks_bench.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = table + "\n\n" + goals_markdown(goals)
    path = write_result(args.results_dir, "many", command, info, args.quick, {"samples": samples}, goals, text)
    if path is not None:
        print(f"results: {path}")


if __name__ == "__main__":
    main()
