"""Many ranks, lockstep: a DDP step on a small model and a ``report()`` per step.

    python benchmarks/jobs/ddp_many_lockstep.py --num-workers 32 [--steps 20]
    python benchmarks/jobs/ddp_many_lockstep.py --num-workers 16 --lockstep-on-ray --spread
    python benchmarks/jobs/ddp_many_lockstep.py --num-workers 16 --ray --spread      # Ray Train

Each rank trains a 2-layer MLP (256-256-10) wrapped by ``prepare_model`` on random batches of 32
and calls ``report()`` after every step (metrics-only); rank 0 times each ``report()`` call and
writes them to a file; the script prints one line ``BENCH_JSON {"report_s": [...], "fit_s": ...}``
(``fit_s``: the time ``fit()`` took). The hand-written twin is ``ddp_many_torchrun.py``, with
``dist.barrier()`` where this calls ``report()`` (benchmarks/many_ranks_bench.py runs both). With
``--ray`` the same script runs on Ray Train 2.60 (only the imports change), with
``--lockstep-on-ray`` on lockstep's Ray executor; both join the cluster named by ``RAY_ADDRESS``
(benchmarks/ray_many_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from on_ray import add_ray_flags, join_ray_if_asked

if "--ray" in sys.argv:  # the same script on Ray Train: only the imports change
    from ray.train import RunConfig, ScalingConfig, get_context, report
    from ray.train.torch import TorchTrainer, prepare_model
else:
    from lockstep import RunConfig, ScalingConfig, get_context, report
    from lockstep.torch import TorchTrainer, prepare_model


def cpu_mark() -> list[float]:
    """[this process's CPU seconds so far (all threads), seconds since it started]."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    stat = Path("/proc/stat").read_text().splitlines()
    boot = next(float(line.split()[1]) for line in stat if line.startswith("btime"))
    return [usage.ru_utime + usage.ru_stime, time.time() - boot - int(fields[19]) / os.sysconf("SC_CLK_TCK")]


def train_func(config: dict[str, Any]) -> None:
    """``steps`` DDP steps, each followed by a timed report(); rank 0 writes its report times.
    With ``marks_dir``, every rank writes its CPU marks there (benchmarks/ray_cpu_split.py)."""
    marking = bool(config.get("marks_dir"))  # else no /proc reads in the measured runs
    marks = {"train_start": cpu_mark()} if marking else {}
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    if marking:
        marks["model_prepared"] = cpu_mark()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(32, 256), torch.randint(0, 10, (32,))
    times = []
    for step in range(config["steps"]):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        started = time.perf_counter()
        report({"step": step, "loss": loss.item()})
        times.append(time.perf_counter() - started)
    if get_context().get_world_rank() == 0:
        Path(config["times_file"]).write_text(json.dumps(times))
    if marking:
        marks["train_end"] = cpu_mark()
        Path(config["marks_dir"], f"rank{get_context().get_world_rank()}.json").write_text(json.dumps(marks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--storage-path", default="/tmp/bench_many_runs")
    add_ray_flags(parser)
    parser.add_argument("--spread", action="store_true", help="placement_strategy='SPREAD' (Ray)")
    parser.add_argument("--marks-dir", default=None, help="each rank writes its CPU marks there (rank<N>.json)")
    args = parser.parse_args()
    join_ray_if_asked(args)
    with tempfile.TemporaryDirectory() as folder:
        times_file = Path(folder, "report_s.json")
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"steps": args.steps, "times_file": str(times_file), "marks_dir": args.marks_dir},
            scaling_config=ScalingConfig(
                num_workers=args.num_workers, use_gpu=False, placement_strategy="SPREAD" if args.spread else "PACK"
            ),
            run_config=RunConfig(storage_path=args.storage_path),
        )
        started = time.perf_counter()
        trainer.fit()
        fit_s = time.perf_counter() - started
        print("BENCH_JSON " + json.dumps({"report_s": json.loads(times_file.read_text()), "fit_s": fit_s}), flush=True)


if __name__ == "__main__":
    main()
