"""Many ranks on one machine, hand-written: a DDP step on a small model and a ``dist.barrier()`` per step.

    python -m torch.distributed.run --nproc_per_node=32 benchmarks/jobs/ddp_many_torchrun.py [--steps 20]

The twin of ``ddp_many_lockstep.py`` (the same model, batches and steps) with a ``dist.barrier()``
where that one calls ``report()``: the floor of any collective on the machine. Rank 0 prints its
barrier times as one line ``BENCH_JSON {"barrier_s": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(32, 256), torch.randint(0, 10, (32,))
    times = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        started = time.perf_counter()
        dist.barrier()
        times.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        print("BENCH_JSON " + json.dumps({"barrier_s": times}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
