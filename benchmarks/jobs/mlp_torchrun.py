"""Seed 003's job with hand-written DDP, for benchmarks/bench_jobs.py.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 \
        benchmarks/jobs/mlp_torchrun.py --data-dir /work/shared/data

gloo process group, ``DistributedSampler(shuffle=False)`` (the seed trains in order), DDP; the
model, data loading and loops are the same code as benchmarks/jobs/mlp_lockstep.py. Rank 0's
validation loss after each epoch is all that is "reported" (printed).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from mlp_common import NeuralNetwork, load_data, stamp, train_epoch, validate_epoch  # noqa: E402
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

# -- hand-written DDP --------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="Fashion-MNIST root (torchvision layout)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training images")
    args = parser.parse_args()
    stamp("imports done")
    started = time.perf_counter()
    dist.init_process_group("gloo")
    stamp("process group ready")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    training, test = load_data(args.data_dir, args.limit)
    batch_size = 64 // world_size
    train_loader = DataLoader(
        training, batch_size=batch_size, num_workers=0, sampler=DistributedSampler(training, shuffle=False)
    )
    test_loader = DataLoader(
        test, batch_size=batch_size, num_workers=0, sampler=DistributedSampler(test, shuffle=False)
    )
    model = DistributedDataParallel(NeuralNetwork())
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = float("nan")
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)
        stamp("training starts")
        train_epoch(train_loader, model, loss_fn, optimizer, world_size)
        stamp("training ends")
        loss = validate_epoch(test_loader, model, loss_fn, world_size)
        stamp("validation ends")
    dist.destroy_process_group()
    stamp("work done")
    if rank == 0:
        print(f"Last result: {{'loss': {loss}}}; main {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
