"""Where the time of seed 003's job goes, lockstep against torchrun + hand-written DDP: the
timeline behind bench_jobs.py's whole-process figure.

Runs ``jobs/mlp_lockstep.py`` (``python job.py`` and ``lockstep run job.py`` with the warm start,
and ``python job.py`` with ``LOCKSTEP_WARM_START=0``: workers started as fresh interpreters) and
``jobs/mlp_torchrun.py`` (2 workers, 1 epoch) in interleaved rounds with ``LOCKSTEP_BENCH_STAMPS=1``:
each process of the job then writes a line when it reaches a point of the job (``jobs/mlp_common.py``'s
``stamp``). Every point is given in seconds from the launch of the command, the median over the rounds
(for a point several processes reach, the last of them: the job waits for it); the process's end is
measured here.

The training phase (from "training starts" to "training ends": the same model, loop and data in
all three) is also compared directly: the ratio of its medians, each lockstep variant over
torchrun, with a round-resampling bootstrap 95% interval (``record.ratio_of_medians``).

    python benchmarks/timeline.py --data-dir /work/shared/data [--rounds 8] [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jobrunner import Variant, job_command, run_job
from machine import describe_machine, machine_line
from record import add_results_args, ratio_of_medians, write_result

LAUNCHERS = [
    Variant("lockstep", "lockstep (python job.py)", "lockstep"),
    Variant("lockstep_run", "lockstep run job.py", "lockstep_run"),
    Variant("lockstep_cold", "lockstep, LOCKSTEP_WARM_START=0", "lockstep", env=(("LOCKSTEP_WARM_START", "0"),)),
    Variant("torchrun", "torchrun + DDP", "torchrun"),
]
LOCKSTEP_POINTS = [
    "imports done",
    "fit starts",
    "train function starts",
    "training starts",
    "training ends",
    "validation ends",
    "fit returns",
    "process exits",
]
#: The points of each launcher's timeline, in the order they come.
POINTS = {
    "lockstep": LOCKSTEP_POINTS,
    "lockstep_run": LOCKSTEP_POINTS,
    "lockstep_cold": LOCKSTEP_POINTS,
    "torchrun": [
        "imports done",
        "process group ready",
        "training starts",
        "training ends",
        "validation ends",
        "work done",
        "process exits",
    ],
}


def stamps_of(log: Path, launched_at: float) -> dict[str, float]:
    """Each point's time from the launch (the latest process to reach it), from the job's log."""
    points: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("STAMP "):
            _, when, _, what = line.split(" ", 3)
            points[what] = max(points.get(what, 0.0), float(when) - launched_at)
    return points


def one_run(variant: Variant, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """Run the job once; its timeline."""
    command, env = job_command(variant, "mlp", [f"--data-dir={args.data_dir}"], folder / "runs")
    env["LOCKSTEP_BENCH_STAMPS"] = "1"
    log = folder / f"{variant.key}.log"
    launched_at = time.time()
    result = run_job(command, env, log, timeout_s=600, sample_rss=False)
    points = stamps_of(log, launched_at)
    points["process exits"] = result.wall_s
    missing = [point for point in POINTS[variant.key] if point not in points]
    if missing:
        raise RuntimeError(f"{shlex.join(command)} wrote no stamp for {missing}; see {log}")
    return points


def markdown(medians: dict[str, dict[str, float]], rounds: int) -> str:
    """One table per launcher: each point and the time since the previous one."""
    lines = [
        f"Seconds from launch, median of {rounds} interleaved round(s) (2 workers, 1 epoch of seed 003's job):",
        "",
    ]
    for variant in LAUNCHERS:
        lines += [f"| {variant.label} | at (s) | since the previous point (s) |", "|---|---:|---:|"]
        previous = 0.0
        for point in POINTS[variant.key]:
            at = medians[variant.key][point]
            lines.append(f"| {point} | {at:.2f} | {at - previous:.2f} |")
            previous = at
        lines.append("")
    return "\n".join(lines)


def training_phases(samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each lockstep variant's training phase over torchrun's: ratio of the medians and its interval."""
    phases = {key: [run["training ends"] - run["training starts"] for run in runs] for key, runs in samples.items()}
    compared = {}
    for key in ("lockstep", "lockstep_run", "lockstep_cold"):
        ratio, interval = ratio_of_medians(phases[key], phases["torchrun"])
        compared[key] = {"median_s": statistics.median(phases[key]), "ratio": ratio, "ci95": interval}
    return {"phases_s": phases, "torchrun_median_s": statistics.median(phases["torchrun"]), "over_torchrun": compared}


def training_markdown(training: dict[str, Any]) -> str:
    lines = [
        "Training phase (training starts -> training ends), over torchrun + DDP's "
        f"({training['torchrun_median_s']:.2f} s median):",
        "",
        "| variant | median (s) | ratio of medians | 95% CI |",
        "|---|---:|---:|---:|",
    ]
    for variant in LAUNCHERS[:2]:
        entry = training["over_torchrun"][variant.key]
        lines.append(
            f"| {variant.label} | {entry['median_s']:.2f} | {entry['ratio']:.3f} | "
            f"{entry['ci95'][0]:.3f} – {entry['ci95'][1]:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--data-dir", required=True, help="Fashion-MNIST root (torchvision layout)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="one round: a check that it works, not a measurement")
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    machine = describe_machine()
    samples: dict[str, list[dict[str, float]]] = {variant.key: [] for variant in LAUNCHERS}
    with tempfile.TemporaryDirectory(prefix="lockstep_timeline") as scratch:
        for round_index in range(args.rounds):
            order = LAUNCHERS if round_index % 2 == 0 else LAUNCHERS[::-1]
            for variant in order:
                points = one_run(variant, args, Path(scratch))
                samples[variant.key].append(points)
                print(
                    f"[{round_index + 1}/{args.rounds}] {variant.label}: exits at {points['process exits']:.2f} s",
                    flush=True,
                )
    medians = {
        key: {point: statistics.median(run[point] for run in runs) for point in POINTS[key]}
        for key, runs in samples.items()
    }
    training = training_phases(samples)
    text = "\n".join(
        [
            machine_line(machine),
            f"Command: `{shlex.join([sys.executable, *sys.argv])}`",
            "",
            markdown(medians, args.rounds),
            training_markdown(training),
        ]
    )
    print(text)
    document: dict[str, Any] = {"samples": samples, "medians": medians, "training": training}
    path = write_result(
        args.results_dir, "timeline", shlex.join(["python", *sys.argv]), machine, args.quick, document, [], text
    )
    if path is not None:
        print(f"results: {path}")


if __name__ == "__main__":
    main()
