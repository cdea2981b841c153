"""A no-op torchrun job for benchmarks/bench_jobs.py.

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/jobs/noop_torchrun.py [--calls 2000]

With ``--calls 0`` (the default) each worker joins the gloo process group, passes one
``dist.barrier()`` and leaves: the whole process then measures start-up and shut-down. With
``--calls N`` each worker makes ``--warmup`` untimed and then N timed ``dist.barrier()`` calls;
rank 0 prints its per-call times as one line ``BENCH_JSON {"barrier_s": [...]}`` (the cost of
the cheapest collective, as a yardstick for lockstep's ``report()``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=0, help="timed barriers (0: one untimed barrier)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed barriers before the timed ones")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if args.calls == 0:
        dist.barrier()
    else:
        for _ in range(args.warmup):
            dist.barrier()
        times = []
        for _ in range(args.calls):
            started = time.perf_counter()
            dist.barrier()
            times.append(time.perf_counter() - started)
        if dist.get_rank() == 0:
            print("BENCH_JSON " + json.dumps({"barrier_s": times}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
