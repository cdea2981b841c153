"""Dashboard cost: a run's training steps with and without ``lockstep dashboard`` watching it.

What it measures
----------------
The dashboard reads storage and never talks to a run's driver or ranks, so watching a run should
cost its steps nothing beyond the reads of the files the run writes. The goal, with its statistic
fixed before measuring: **the ratio of the medians of the training-phase steps/s (watched over
unwatched), from ``--rounds`` interleaved rounds (default 10, at least 5), judged by the lower
end of its round-resampling bootstrap 95% interval: >= 0.98** (a dashboard costs at most 2 %).

Each round runs the same 2-worker job twice, in alternating order (watched first in even
rounds): the seed 003 MLP on Fashion-MNIST (``prepare_model`` + ``prepare_data_loader``, batch
32 per worker, shuffled), ``--steps`` timed steps after 20 untimed ones, a ``report()`` every
``--steps-per-report`` steps (default 10: the report history and the record change often, the
dashboard's worst case), with a checkpoint every 10th report. Rank 0's steps/s is the round's
figure.

One ``lockstep dashboard`` serves the storage path for the whole benchmark (idle between
watched runs). While a watched run goes on, a viewer process asks the dashboard for what an open
run page asks for, as often as the page does (the run's new reports every 2 s, its details and
log tails every 5 s) and for the runs list every 5 s; the browser itself would run on the
viewer's laptop, so it is not started here.

How to run
----------
    .venv/bin/python benchmarks/dashboard_bench.py [--rounds 10] [--steps 1500] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "jobs"))

from machine import describe_machine, machine_line  # noqa: E402 - benchmarks/ is the script folder
from record import Goal, add_results_args, ratio_of_medians, write_result  # noqa: E402

GOAL_RATIO = 0.98
WARMUP_STEPS = 20
BATCH = 32
#: What an open run page polls, and how often (seconds): see lockstep/dashboard/static/run.js.
PAGE_POLLS = (("reports?since={since}", 2.0), ("", 5.0), ("logs", 5.0))
LIST_POLL_S = 5.0


# -- the job (on every rank) ----------------------------------------------------------------------


def train_func(config: dict[str, Any]) -> float:
    """Train; return rank 0's steps/s over the timed steps."""
    import tempfile as scratch

    import torch
    from mlp_common import NeuralNetwork, load_data
    from torch import nn
    from torch.utils.data import DataLoader

    from lockstep import Checkpoint, report
    from lockstep.torch import prepare_data_loader, prepare_model

    torch.manual_seed(0)
    training, _ = load_data(config["data_dir"], None)
    loader = prepare_data_loader(DataLoader(training, batch_size=BATCH, shuffle=True))
    model = prepare_model(NeuralNetwork())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.NLLLoss()
    batches = iter(loader)
    started = 0.0
    for step in range(WARMUP_STEPS + config["steps"]):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if (step + 1) % config["steps_per_report"] == 0:
            checkpoint = None
            if (step + 1) % (10 * config["steps_per_report"]) == 0:
                folder = scratch.mkdtemp()
                torch.save(model.state_dict(), Path(folder, "model.pt"))
                checkpoint = Checkpoint.from_directory(folder)
            report({"step": step, "loss": loss.item()}, checkpoint=checkpoint)
    return config["steps"] / (time.perf_counter() - started)


def one_run(storage: str, name: str, config: dict[str, Any]) -> float:
    from lockstep import CheckpointConfig, RunConfig, ScalingConfig
    from lockstep.torch import TorchTrainer

    run_config = RunConfig(
        name=name, storage_path=storage, verbose=0, checkpoint_config=CheckpointConfig(num_to_keep=2)
    )
    result = TorchTrainer(
        train_func, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2), run_config=run_config
    ).fit()
    return float(result.return_value)


# -- the viewer (its own process) -------------------------------------------------------------------


def view(base: str, run: str, requests: list[int]) -> None:
    """Ask ``base`` (the dashboard) what an open page of ``run`` and the runs list ask, as often,
    until this process is stopped; ``requests[0]`` counts the requests."""
    due = {path: 0.0 for path, _ in PAGE_POLLS} | {"/": 0.0}
    periods = dict(PAGE_POLLS) | {"/": LIST_POLL_S}
    since = 0
    while True:
        now = time.monotonic()
        for path, when in due.items():
            if now < when:
                continue
            url = f"{base}api/runs" if path == "/" else f"{base}api/runs/{run}/{path.format(since=since)}".rstrip("/")
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    answer = json.loads(response.read())
                if path.startswith("reports"):
                    since = answer["count"]
            except (urllib.error.URLError, OSError, ValueError):
                pass  # the run's folder may not be there yet
            requests[0] += 1
            due[path] = now + periods[path]
        time.sleep(max(0.0, min(due.values()) - time.monotonic()))


def start_viewer(base: str, run: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, "--viewer", base, run], stdout=subprocess.PIPE, text=True)


def start_dashboard(storage: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "lockstep.cli", "dashboard", "--storage", storage, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("dashboard: "):
        process.kill()
        raise RuntimeError(f"the dashboard did not start: {line!r}")
    return process, line.split(" ", 1)[1].strip()


# -- rounds and the goal ------------------------------------------------------------------------------


def run_rounds(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"watched": [], "unwatched": []}
    viewer_requests: list[int] = []
    with tempfile.TemporaryDirectory() as storage:
        Path(storage, "results").mkdir()
        storage = str(Path(storage, "results"))
        dashboard, base = start_dashboard(storage)
        try:
            for round_index in range(args.rounds):
                order = ["watched", "unwatched"] if round_index % 2 == 0 else ["unwatched", "watched"]
                for kind in order:
                    name = f"{kind}-{round_index}"
                    viewer = start_viewer(base, name) if kind == "watched" else None
                    try:
                        rates[kind].append(one_run(storage, name, config))
                    finally:
                        if viewer is not None:
                            viewer.terminate()
                            output, _ = viewer.communicate()
                            viewer_requests.append(int(output.strip() or 0))
                print(
                    f"round {round_index + 1}/{args.rounds}: watched {rates['watched'][-1]:.1f} steps/s, "
                    f"unwatched {rates['unwatched'][-1]:.1f} steps/s",
                    file=sys.stderr,
                )
        finally:
            dashboard.kill()
            dashboard.communicate()
    return {"rates": rates, "viewer_requests": viewer_requests}


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], list[Goal]]:
    rates = raw["rates"]
    ratio, interval = ratio_of_medians(rates["watched"], rates["unwatched"])
    summary = {
        "medians_steps_per_s": {kind: statistics.median(values) for kind, values in rates.items()},
        "ratio_of_medians": ratio,
        "ratio_of_medians_ci95": interval,
        "viewer_requests_per_run": statistics.median(raw["viewer_requests"]) if raw["viewer_requests"] else 0,
    }
    goal = Goal(
        "training-phase steps/s, a run watched by lockstep dashboard / unwatched",
        f"median(watched steps/s) / median(unwatched steps/s), rank 0, {args.rounds} interleaved rounds of "
        f"{args.steps} steps of a 2-worker run; judged by the lower end of the round-resampling bootstrap 95% "
        "interval",
        ratio,
        GOAL_RATIO,
        at_most=False,
        ci95=interval,
        rounds=args.rounds,
    )
    return summary, [goal]


def markdown(
    summary: dict[str, Any], goals: list[Goal], args: argparse.Namespace, info: dict[str, str], command: str
) -> str:
    from record import goals_markdown

    medians = summary["medians_steps_per_s"]
    low, high = summary["ratio_of_medians_ci95"]
    return "\n".join(
        [
            machine_line(info),
            f"Command: `{command}`",
            f"2 workers, gloo; {args.rounds} interleaved rounds of {args.steps} steps, a report every "
            f"{args.steps_per_report} steps; the viewer made {summary['viewer_requests_per_run']:.0f} requests per "
            "watched run (median).",
            "",
            "| | steps/s (median of rounds) |",
            "|---|---:|",
            f"| unwatched | {medians['unwatched']:.1f} |",
            f"| watched by lockstep dashboard | {medians['watched']:.1f} |",
            f"| ratio (watched / unwatched) | {summary['ratio_of_medians']:.4f} (95% CI {low:.4f} – {high:.4f}) |",
            "",
            goals_markdown(goals),
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10, at least 5 to judge)")
    parser.add_argument("--steps", type=int, default=1500, help="timed steps per run (default 1500)")
    parser.add_argument("--steps-per-report", type=int, default=10, help="steps between reports (default 10)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a check that it works, not a measurement: 2 rounds of 100 steps (its goal reads MISS: too few rounds)",
    )
    parser.add_argument(
        "--data-dir", default=None, help="Fashion-MNIST root (default $LOCKSTEP_DATA or ../shared/data)"
    )
    parser.add_argument("--viewer", nargs=2, metavar=("URL", "RUN"), help=argparse.SUPPRESS)
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 100
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.viewer:
        import signal

        requests = [0]
        signal.signal(signal.SIGTERM, lambda *_: (print(requests[0], flush=True), sys.exit(0)))
        view(*args.viewer, requests)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    from bench_jobs import default_data_dir

    info = describe_machine()
    config = {
        "data_dir": args.data_dir or default_data_dir(),
        "steps": args.steps,
        "steps_per_report": args.steps_per_report,
    }
    raw = run_rounds(args, config)
    summary, goals = summarize(raw, args)
    text = markdown(summary, goals, args, info, command)
    print(text)
    document = {
        "config": {key: value for key, value in vars(args).items() if key != "viewer"},
        "summary": summary,
        "raw": raw,
    }
    path = write_result(args.results_dir, "dashboard", command, info, args.quick, document, goals, text)
    if path is not None:
        print(f"results: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
