"""Seed 003's job on lockstep (or on Ray Train with ``--ray``), for benchmarks/bench_jobs.py.

The MLP of examples/fashion_mnist_mlp.py (784-512-128-64-10, LogSoftmax), SGD lr 1e-3, global
batch 64 (64 / world size per worker), the 60,000 training images in order (no shuffling, as
in the seed), 1 epoch, then validation on the 10,000 test images; ``report()`` once per epoch.
Each worker reads Fashion-MNIST itself (torchvision ``FashionMNIST`` + ``ToTensor``,
``DataLoader(num_workers=0)``), exactly like benchmarks/jobs/mlp_torchrun.py, whose model and
loop are the same code.

    python benchmarks/jobs/mlp_lockstep.py --data-dir /work/shared/data --num-workers 2
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision import datasets
from torchvision.transforms import ToTensor

if "--ray" in sys.argv:  # the same script on Ray Train: only the imports change
    from ray.train import RunConfig, ScalingConfig, get_context, report
    from ray.train.torch import TorchTrainer, prepare_data_loader, prepare_model
else:
    from lockstep import RunConfig, ScalingConfig, get_context, report
    from lockstep.torch import TorchTrainer, prepare_data_loader, prepare_model


# -- identical in mlp_torchrun.py ------------------------------------------------------------


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


# -- lockstep / Ray Train ----------------------------------------------------------------------


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    """Runs on every worker."""
    world_size = get_context().get_world_size()
    torch.manual_seed(0)
    training, test = load_data(config["data_dir"], config["limit"])
    batch_size = config["batch_size"] // world_size
    train_loader = prepare_data_loader(DataLoader(training, batch_size=batch_size, num_workers=0))
    test_loader = prepare_data_loader(DataLoader(test, batch_size=batch_size, num_workers=0))
    model = prepare_model(NeuralNetwork())
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    loss = float("nan")
    for _ in range(config["epochs"]):
        train_epoch(train_loader, model, loss_fn, optimizer, world_size)
        loss = validate_epoch(test_loader, model, loss_fn, world_size)
        report({"loss": loss})
    return {"loss": loss}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="Fashion-MNIST root (torchvision layout)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training images")
    parser.add_argument("--storage-path", default="/tmp/bench_jobs_runs", help="where runs are kept")
    parser.add_argument("--ray", action="store_true", help="run on Ray Train instead of lockstep")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    if args.ray:
        import ray

        ray.init(num_cpus=args.num_workers + 1, include_dashboard=False, log_to_driver=False)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"lr": 1e-3, "batch_size": 64, "epochs": args.epochs,
                           "data_dir": args.data_dir, "limit": args.limit},
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
        run_config=RunConfig(storage_path=args.storage_path),
    )
    result = trainer.fit()
    print(f"Last result: {result.metrics}; fit {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
