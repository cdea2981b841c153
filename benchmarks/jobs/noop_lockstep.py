"""A no-op lockstep job (on Ray Train with ``--ray``; on lockstep's Ray executor with
``--lockstep-on-ray``) for benchmarks/bench_jobs.py and benchmarks/ray_bench.py.

With ``--calls 0`` (the default) each of the workers calls ``report()`` once and returns: the
whole process then measures start-up and shut-down. With ``--calls N`` each worker makes
``--warmup`` untimed and then N timed metrics-only ``report()`` calls; rank 0's per-call times
are printed by the driver as one line ``BENCH_JSON {"report_s": [...]}``.

    python benchmarks/jobs/noop_lockstep.py --num-workers 2 [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch  # noqa: F401 - as users write scripts: torch before lockstep or Ray Train
from on_ray import add_ray_flags, join_ray_if_asked

if "--ray" in sys.argv:  # the same script on Ray Train: only the imports change
    from ray.train import RunConfig, ScalingConfig, get_context, report
    from ray.train.torch import TorchTrainer
else:
    from lockstep import RunConfig, ScalingConfig, get_context, report
    from lockstep.torch import TorchTrainer


def train_func(config: dict[str, Any]) -> None:
    """Report once, or warm-up + N timed reports (rank 0 writes the N durations to a file:
    Ray Train's Result has no return value, and its workers' output may not reach the driver)."""
    if config["calls"] == 0:
        report({"done": 1})
        return
    for step in range(config["warmup"]):
        report({"step": step})
    times = []
    for step in range(config["calls"]):
        started = time.perf_counter()
        report({"step": step, "loss": 0.5})
        times.append(time.perf_counter() - started)
    if get_context().get_world_rank() == 0:
        Path(config["times_file"]).write_text(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=0, help="timed report() calls (0: one untimed call)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed report() calls before the timed ones")
    parser.add_argument("--storage-path", default="/tmp/bench_jobs_runs", help="where runs are kept")
    add_ray_flags(parser)
    args = parser.parse_args()
    join_ray_if_asked(args)
    with tempfile.TemporaryDirectory() as folder:
        times_file = Path(folder, "report_s.json")
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"calls": args.calls, "warmup": args.warmup, "times_file": str(times_file)},
            scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
            run_config=RunConfig(storage_path=args.storage_path),
        )
        trainer.fit()
        if args.calls:
            print("BENCH_JSON " + json.dumps({"report_s": json.loads(times_file.read_text())}))


if __name__ == "__main__":
    main()
