"""Seed 000's job on lockstep: ResNet18 (1-channel conv1) on Fashion-MNIST, Adam 1e-3, batch
128 per worker, a checkpoint every epoch; then the model is loaded back from
``result.checkpoint`` and its test accuracy printed.

    python examples/fashion_mnist_resnet18.py --num-workers 2 --epochs 1 --smoke-test
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Any

import torch
from torch.nn import CrossEntropyLoss
from torch.optim import Adam
from torch.utils.data import DataLoader
from torchvision.models import resnet18
from torchvision.transforms import Compose, Normalize, ToTensor

import lockstep
import lockstep.torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist_data import load_fashion_mnist, subset  # noqa: E402
from plotting import plot_metrics  # noqa: E402

TRANSFORM = Compose([ToTensor(), Normalize((0.28604,), (0.32025,))])


def build_model() -> torch.nn.Module:
    """ResNet18 for 1-channel 28x28 images."""
    model = resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
    return model


def train_func(config: dict[str, Any]) -> None:
    """Runs on every worker."""
    model = lockstep.torch.prepare_model(build_model())
    criterion = CrossEntropyLoss()
    optimizer = Adam(model.parameters(), lr=0.001)
    train_data = subset(load_fashion_mnist(config["data_dir"], train=True, transform=TRANSFORM), config["limit"])
    train_loader = lockstep.torch.prepare_data_loader(DataLoader(train_data, batch_size=128, shuffle=True))

    for epoch in range(config["epochs"]):
        if lockstep.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        for images, labels in train_loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        metrics = {"loss": loss.item(), "epoch": epoch}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            checkpoint = None
            if lockstep.get_context().get_world_rank() == 0:  # one writer: BatchNorm's running stats differ per rank
                state = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
                torch.save(state, os.path.join(temp_checkpoint_dir, "model.pt"))
                checkpoint = lockstep.Checkpoint.from_directory(temp_checkpoint_dir)
            lockstep.report(metrics, checkpoint=checkpoint)
        if lockstep.get_context().get_world_rank() == 0:
            print(metrics, flush=True)


def evaluate(model: torch.nn.Module, data_dir: str | None, limit: int | None) -> float:
    """Accuracy of ``model`` on the Fashion-MNIST test set (its first ``limit`` images)."""
    test_data = subset(load_fashion_mnist(data_dir, train=False, transform=TRANSFORM), limit)
    model.eval()
    correct = 0
    with torch.no_grad():
        for images, labels in DataLoader(test_data, batch_size=256):
            correct += (model(images).argmax(1) == labels).sum().item()
    return correct / len(test_data)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", "-n", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--smoke-test", action="store_true", help="1,024 training and 512 test images")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST root (default: $LOCKSTEP_DATA, else ~/data)")
    parser.add_argument("--storage-path", default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--plot", default="fashion_mnist_resnet18.png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    limit = 1024 if args.smoke_test else None
    trainer = lockstep.torch.TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "data_dir": args.data_dir, "limit": limit},
        scaling_config=lockstep.ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        run_config=lockstep.RunConfig(storage_path=args.storage_path, name=args.name),
    )
    result = trainer.fit()

    with result.checkpoint.as_directory() as checkpoint_dir:
        model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"), weights_only=True)
    model = build_model()
    model.load_state_dict(model_state_dict)
    accuracy = evaluate(model, args.data_dir, limit // 2 if limit else None)
    print(f"Checkpoint: {result.checkpoint.path}")
    print(f"Test accuracy: {100 * accuracy:.2f}%")
    if args.plot:
        plot_metrics(
            result.metrics_dataframe,
            {"loss": "training loss (last batch)"},
            args.plot,
            f"Fashion-MNIST ResNet18, {args.num_workers} workers",
        )
        print(f"Plot: {os.path.abspath(args.plot)}")


if __name__ == "__main__":
    main()
