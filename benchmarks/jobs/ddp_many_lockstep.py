"""Many ranks on one machine, lockstep: a DDP step on a small model and a ``report()`` per step.

    python benchmarks/jobs/ddp_many_lockstep.py --num-workers 32 [--steps 20]

Each rank trains a 2-layer MLP (256-256-10) wrapped by ``prepare_model`` on random batches of 32
and calls ``report()`` after every step (metrics-only); rank 0 times each ``report()`` call and
the driver prints them as one line ``BENCH_JSON {"report_s": [...]}``. The hand-written twin is
``ddp_many_torchrun.py``, with ``dist.barrier()`` where this calls ``report()``
(benchmarks/many_ranks_bench.py runs both).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer, prepare_model


def train_func(config: dict[str, Any]) -> list[float]:
    """``steps`` DDP steps, each followed by a timed report(); rank 0's report times."""
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(32, 256), torch.randint(0, 10, (32,))
    times = []
    for step in range(config["steps"]):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        started = time.perf_counter()
        lockstep.report({"step": step, "loss": loss.item()})
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--storage-path", default="/tmp/bench_many_runs")
    args = parser.parse_args()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"steps": args.steps},
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(storage_path=args.storage_path),
    )
    result = trainer.fit()
    print("BENCH_JSON " + json.dumps({"report_s": result.return_value}), flush=True)


if __name__ == "__main__":
    main()
