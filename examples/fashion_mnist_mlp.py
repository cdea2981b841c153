"""Seed 003's job on lockstep: an MLP on Fashion-MNIST, SGD, global batch 64, validation loss
and accuracy reported every epoch.

    python examples/fashion_mnist_mlp.py --num-workers 2 --epochs 2 --plot mlp.png

Moving the original Ray Train script here took only its imports: ``ray.train`` became
``lockstep``, ``ray.air.session`` became ``lockstep.session`` and ``ray.air.config`` became
``lockstep.config``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import ToTensor

import lockstep as train
from lockstep import RunConfig, session
from lockstep.config import ScalingConfig
from lockstep.torch import TorchTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist_data import load_fashion_mnist, subset  # noqa: E402
from plotting import plot_metrics  # noqa: E402


class NeuralNetwork(nn.Module):
    """The seed's fully connected network: 784 -> 512 -> 128 -> 64 -> 10, log-softmax output."""

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


def train_epoch(dataloader: Any, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One pass over this worker's shard; returns the mean training loss."""
    model.train()
    total, batches = 0.0, 0
    for inputs, labels in dataloader:
        loss = loss_fn(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total, batches = total + loss.item(), batches + 1
    return total / max(batches, 1)


def validate_epoch(dataloader: Any, model: nn.Module, loss_fn: nn.Module) -> tuple[float, float]:
    """Loss and accuracy over the whole test set (every worker's shard, summed across workers)."""
    model.eval()
    sums = torch.zeros(3)  # loss * items, correct, items
    with torch.no_grad():
        for inputs, labels in dataloader:
            prediction = model(inputs)
            sums += torch.tensor(
                [
                    loss_fn(prediction, labels).item() * len(labels),
                    (prediction.argmax(1) == labels).sum().item(),
                    len(labels),
                ]
            )
    if dist.is_initialized():
        dist.all_reduce(sums)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def train_func(config: dict[str, Any]) -> None:
    """Runs on every worker."""
    worker_batch_size = config["batch_size"] // session.get_world_size()
    training_data = subset(load_fashion_mnist(config["data_dir"], train=True, transform=ToTensor()), config["limit"])
    test_data = subset(load_fashion_mnist(config["data_dir"], train=False, transform=ToTensor()), config["limit"])
    train_dataloader = train.torch.prepare_data_loader(
        DataLoader(training_data, batch_size=worker_batch_size, shuffle=True)
    )
    test_dataloader = train.torch.prepare_data_loader(DataLoader(test_data, batch_size=worker_batch_size))

    model = train.torch.prepare_model(NeuralNetwork())
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])

    for epoch in range(config["epochs"]):
        if session.get_world_size() > 1:
            train_dataloader.sampler.set_epoch(epoch)
        train_loss = train_epoch(train_dataloader, model, loss_fn, optimizer)
        val_loss, val_accuracy = validate_epoch(test_dataloader, model, loss_fn)
        if session.get_world_rank() == 0:
            print(
                f"epoch {epoch + 1}/{config['epochs']}: train loss {train_loss:.4f}, "
                f"validation loss {val_loss:.4f}, accuracy {100 * val_accuracy:.1f}%",
                flush=True,
            )
        session.report(dict(epoch=epoch, train_loss=train_loss, loss=val_loss, accuracy=val_accuracy))


def train_fashion_mnist(args: argparse.Namespace) -> train.Result:
    """Train with lockstep and return the Result."""
    trainer = TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config={
            "lr": args.lr,
            "momentum": args.momentum,
            "batch_size": 64,
            "epochs": args.epochs,
            "data_dir": args.data_dir,
            "limit": 2000 if args.smoke_test else None,
        },
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        run_config=RunConfig(storage_path=args.storage_path, name=args.name),
    )
    return trainer.fit()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", "-n", type=int, default=2, help="number of workers")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (the seed's 1e-3)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (the seed uses none)")
    parser.add_argument("--smoke-test", action="store_true", help="2,000 images, for a quick check")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST root (default: $LOCKSTEP_DATA, else ~/data)")
    parser.add_argument("--storage-path", default=None, help="where runs are kept (default ~/lockstep_results)")
    parser.add_argument("--name", default=None, help="run name (default: TorchTrainer_<time>)")
    parser.add_argument("--plot", default="fashion_mnist_mlp.png", help="PNG of the curves to write")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    result = train_fashion_mnist(args)
    print(f"Last result: {result.metrics}")
    print(f"Run folder: {result.path}")
    if args.plot:
        plot_metrics(
            result.metrics_dataframe,
            {"train_loss": "training loss", "loss": "validation loss", "accuracy": "validation accuracy"},
            args.plot,
            f"Fashion-MNIST MLP, {args.num_workers} workers",
        )
        print(f"Plot: {os.path.abspath(args.plot)}")


if __name__ == "__main__":
    main()
