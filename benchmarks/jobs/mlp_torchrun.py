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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets
from torchvision.transforms import ToTensor

# -- identical in mlp_lockstep.py ------------------------------------------------------------


class NeuralNetwork(nn.Module):
    """784 -> 512 -> 128 -> 64 -> 10, log-softmax output (seed 003's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512), nn.ReLU(),
            nn.Linear(512, 128), nn.ReLU(),
            nn.Linear(128, 64), nn.ReLU(),
            nn.Linear(64, 10), nn.LogSoftmax(dim=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_relu_stack(self.flatten(x))


def load_data(data_dir: str, limit: int | None) -> tuple[Any, Any]:
    """Fashion-MNIST train and test sets (the first ``limit`` training images when given)."""
    training = datasets.FashionMNIST(root=data_dir, train=True, download=False, transform=ToTensor())
    test = datasets.FashionMNIST(root=data_dir, train=False, download=False, transform=ToTensor())
    if limit is not None:
        training = Subset(training, range(min(limit, len(training))))
    return training, test


def train_epoch(dataloader: Any, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer,
                world_size: int) -> None:
    """Seed 003's training loop (prints the loss every 100 batches)."""
    size = len(dataloader.dataset) // world_size
    model.train()
    for batch, (x, y) in enumerate(dataloader):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if batch % 100 == 0:
            print(f"loss: {loss.item():>7f}  [{batch * len(x):>5d}/{size:>5d}]")


def validate_epoch(dataloader: Any, model: nn.Module, loss_fn: nn.Module, world_size: int) -> float:
    """Seed 003's validation loop: this worker's shard of the test set; returns its mean loss."""
    size = len(dataloader.dataset) // world_size
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for x, y in dataloader:
            prediction = model(x)
            test_loss += loss_fn(prediction, y).item()
            correct += (prediction.argmax(1) == y).type(torch.float).sum().item()
    test_loss /= max(len(dataloader), 1)
    print(f"Test Error: \n Accuracy: {100 * correct / size:>0.1f}%, Avg loss: {test_loss:>8f} \n")
    return test_loss


# -- hand-written DDP --------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="Fashion-MNIST root (torchvision layout)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training images")
    args = parser.parse_args()
    started = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    training, test = load_data(args.data_dir, args.limit)
    batch_size = 64 // world_size
    train_loader = DataLoader(training, batch_size=batch_size, num_workers=0,
                              sampler=DistributedSampler(training, shuffle=False))
    test_loader = DataLoader(test, batch_size=batch_size, num_workers=0,
                             sampler=DistributedSampler(test, shuffle=False))
    model = DistributedDataParallel(NeuralNetwork())
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = float("nan")
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)
        train_epoch(train_loader, model, loss_fn, optimizer, world_size)
        loss = validate_epoch(test_loader, model, loss_fn, world_size)
    dist.destroy_process_group()
    if rank == 0:
        print(f"Last result: {{'loss': {loss}}}; main {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
