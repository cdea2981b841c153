"""Step overhead: training steps/s with ``prepare_model`` + ``prepare_data_loader`` vs hand-written
DDP + ``DistributedSampler``, in the same worker processes.

What it measures
----------------
One lockstep run with 2 CPU workers (gloo). In each worker, the seed 003 MLP trains on
Fashion-MNIST (``ToTensor``, global batch 64 = 32 per worker, shuffled) in rounds that alternate
the two set-ups, A B A B …, each round a fresh model, optimizer and loader and ``--steps`` timed
steps (forward, loss, backward, SGD step) after 20 untimed ones:

* **prepared**: ``prepare_model(model)`` and ``prepare_data_loader(DataLoader(..., shuffle=True))``;
* **hand-written**: ``DistributedDataParallel(model)`` and ``DataLoader(..., sampler=DistributedSampler(...))``.

Rank 0's steps/s per round; medians over rounds. The goal (prepared >= 0.99 x hand-written) is
judged on the median of the per-round ratios: the two set-ups of a round run back to back, so
drifts of the machine's load cancel in their ratio.

How to run
----------
    .venv/bin/python benchmarks/step_bench.py [--rounds 10] [--steps 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "jobs"))

from machine import describe_machine  # noqa: E402 - benchmarks/ is the script folder

GOAL = 0.99
WARMUP_STEPS = 20


def timed_steps(loader: Any, model: Any, optimizer: Any, steps: int) -> float:
    """Steps per second over ``steps`` steps, after the warm-up ones."""
    import torch

    loss_fn = torch.nn.CrossEntropyLoss()
    batches = iter(loader)
    started = 0.0
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return steps / (time.perf_counter() - started)


def prepared_setup(dataset: Any) -> tuple[Any, Any]:
    from torch.utils.data import DataLoader

    from lockstep.torch import prepare_data_loader, prepare_model
    from mlp_common import NeuralNetwork

    return prepare_data_loader(DataLoader(dataset, batch_size=32, shuffle=True)), prepare_model(NeuralNetwork())


def hand_written_setup(dataset: Any) -> tuple[Any, Any]:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from mlp_common import NeuralNetwork

    return DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset)), DistributedDataParallel(NeuralNetwork())


def train_func(config: dict[str, Any]) -> dict[str, list[float]]:
    """Alternate the two set-ups; return the steps/s of each round."""
    import torch

    from mlp_common import load_data

    training, _ = load_data(config["data_dir"], None)
    rates: dict[str, list[float]] = {"prepared": [], "hand_written": []}
    setups = {"prepared": prepared_setup, "hand_written": hand_written_setup}
    for round_index in range(config["rounds"]):
        order = ["prepared", "hand_written"] if round_index % 2 == 0 else ["hand_written", "prepared"]
        for name in order:
            torch.manual_seed(round_index)
            loader, model = setups[name](training)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            rates[name].append(timed_steps(loader, model, optimizer, config["steps"]))
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10, help="rounds per set-up (default 10)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per round (default 300)")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST root (default $LOCKSTEP_DATA or ../shared/data)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)

    import tempfile

    from bench_jobs import default_data_dir
    from lockstep import RunConfig, ScalingConfig
    from lockstep.torch import TorchTrainer

    info = describe_machine()
    with tempfile.TemporaryDirectory() as storage:
        result = TorchTrainer(
            train_func,
            train_loop_config={"data_dir": args.data_dir or default_data_dir(), "rounds": args.rounds, "steps": args.steps},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=storage),
        ).fit()
    rates = result.return_value
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["prepared"] / medians["hand_written"]
    paired = statistics.median(a / b for a, b in zip(rates["prepared"], rates["hand_written"]))
    print(f"Machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}; {info['date']}")
    print(f"Command: `{' '.join([sys.executable, *sys.argv])}`")
    print(f"2 workers, gloo, rank 0; {args.rounds} rounds x {args.steps} steps per set-up, alternated; medians\n")
    print("| set-up | steps/s median | min | max |\n|---|---:|---:|---:|")
    for name, values in rates.items():
        print(f"| {name.replace('_', '-')} | {medians[name]:.1f} | {min(values):.1f} | {max(values):.1f} |")
    print(f"| prepared / hand-written, ratio of medians | {ratio:.3f} | | |")
    print(f"| prepared / hand-written, median of per-round ratios (goal >= {GOAL}) | {paired:.3f} | | "
          f"{'PASS' if paired >= GOAL else 'MISS'} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "rates": rates, "medians": medians, "ratio": ratio,
                                         "paired_ratio": paired,
                                         "goal": GOAL, "config": vars(args) | {"json": str(args.json)}}, indent=1))


if __name__ == "__main__":
    main()
