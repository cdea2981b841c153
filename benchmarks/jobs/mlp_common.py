"""Seed 003's model, data loading and loops, shared by mlp_lockstep.py and mlp_torchrun.py so
that both launchers run exactly the same training code."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset
from torchvision import datasets
from torchvision.transforms import ToTensor

STAMPS = os.environ.get("LOCKSTEP_BENCH_STAMPS") == "1"


def stamp(what: str) -> None:
    """With ``LOCKSTEP_BENCH_STAMPS=1`` (benchmarks/timeline.py): say when this process reached
    ``what`` (a line ``STAMP <epoch seconds> <pid> <what>`` on stderr); else nothing."""
    if STAMPS:
        sys.stderr.write(f"STAMP {time.time():.4f} {os.getpid()} {what}\n")
        sys.stderr.flush()


class NeuralNetwork(nn.Module):
    """784 -> 512 -> 128 -> 64 -> 10, log-softmax output (seed 003's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Linear(512, 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
            nn.LogSoftmax(dim=1),
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


def train_epoch(
    dataloader: Any, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer, world_size: int
) -> None:
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
