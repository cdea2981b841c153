"""Several no-op ``fit()`` calls in one lockstep driver process, for benchmarks/bench_jobs.py.

Each fit has ``--num-workers`` workers that call ``report()`` once and return. The wall time of
each ``trainer.fit()`` call is printed by the driver as one line ``BENCH_JSON {"fit_s": [...]}``;
the first fit pays the start-up, the later ones show what a further ``fit()`` in the same process
costs (a notebook or a sweep calling ``fit()`` again).

    python benchmarks/jobs/refit_lockstep.py --num-workers 2 --fits 4
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from lockstep import RunConfig, ScalingConfig, report
from lockstep.torch import TorchTrainer


def train_func(config: dict[str, Any]) -> None:
    """Report once."""
    report({"done": 1})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--fits", type=int, default=4, help="fit() calls in a row (default 4)")
    parser.add_argument("--storage-path", default="/tmp/bench_jobs_runs", help="where runs are kept")
    args = parser.parse_args()
    times = []
    for index in range(args.fits):
        trainer = TorchTrainer(
            train_func,
            scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
            run_config=RunConfig(name=f"refit_{index}", storage_path=args.storage_path),
        )
        started = time.perf_counter()
        trainer.fit()
        times.append(time.perf_counter() - started)
    print("BENCH_JSON " + json.dumps({"fit_s": times}), flush=True)


if __name__ == "__main__":
    main()
