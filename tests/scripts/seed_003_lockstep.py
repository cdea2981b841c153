# Seed 003's Ray Train script with only its imports swapped to lockstep (marked "swapped").
# Test-only edits keep it fast and offline (marked "test-only"): the data folder, a subset of the
# data, 1 epoch instead of 50, and `--address none`, which skips `ray.init(...)` so that the same
# script also runs on lockstep's local executor. With `ray.init(...)` kept, lockstep runs the
# workers on that Ray cluster.
# The seed's code stays as it was (its import order, typing.Dict, super(NeuralNetwork, self), its
# black layout at 88 columns), so ruff neither formats it nor applies the rules that would rewrite it:
# ruff: noqa: I001, UP006, UP008, UP035
# fmt: off
import argparse
import os
from typing import Dict

from lockstep import session  # swapped: from ray.air import session
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision import datasets
from torchvision.transforms import ToTensor

import lockstep as train  # swapped: import ray.train as train
from lockstep.torch import TorchTrainer  # swapped: from ray.train.torch import TorchTrainer
from lockstep.config import ScalingConfig  # swapped: from ray.air.config import ScalingConfig

DATA_ROOT = os.environ["LOCKSTEP_DATA"]  # test-only: the seed downloads to "~/data"
SUBSET = 2000  # test-only: the seed trains on all 60,000 images

# Download training data from open datasets.
training_data = Subset(datasets.FashionMNIST(
    root=DATA_ROOT,
    train=True,
    download=True,
    transform=ToTensor(),
), range(SUBSET))

# Download test data from open datasets.
test_data = Subset(datasets.FashionMNIST(
    root=DATA_ROOT,
    train=False,
    download=True,
    transform=ToTensor(),
), range(SUBSET // 4))


# Define model
class NeuralNetwork(nn.Module):
    def __init__(self):
        super(NeuralNetwork, self).__init__()
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

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits


def train_epoch(dataloader, model, loss_fn, optimizer):
    size = len(dataloader.dataset) // session.get_world_size()
    model.train()
    for batch, (X, y) in enumerate(dataloader):
        # Compute prediction error
        pred = model(X)
        loss = loss_fn(pred, y)

        # Backpropagation
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if batch % 100 == 0:
            loss, current = loss.item(), batch * len(X)
            print(f"loss: {loss:>7f}  [{current:>5d}/{size:>5d}]")


def validate_epoch(dataloader, model, loss_fn):
    size = len(dataloader.dataset) // session.get_world_size()
    num_batches = len(dataloader)
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for X, y in dataloader:
            pred = model(X)
            test_loss += loss_fn(pred, y).item()
            correct += (pred.argmax(1) == y).type(torch.float).sum().item()
    test_loss /= num_batches
    correct /= size
    print(
        f"Test Error: \n "
        f"Accuracy: {(100 * correct):>0.1f}%, "
        f"Avg loss: {test_loss:>8f} \n"
    )
    return test_loss


def train_func(config: Dict):
    batch_size = config["batch_size"]
    lr = config["lr"]
    epochs = config["epochs"]

    worker_batch_size = batch_size // session.get_world_size()

    # Create data loaders.
    train_dataloader = DataLoader(training_data, batch_size=worker_batch_size)
    test_dataloader = DataLoader(test_data, batch_size=worker_batch_size)

    train_dataloader = train.torch.prepare_data_loader(train_dataloader)
    test_dataloader = train.torch.prepare_data_loader(test_dataloader)

    # Create model.
    model = NeuralNetwork()
    model = train.torch.prepare_model(model)

    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    for _ in range(epochs):
        train_epoch(train_dataloader, model, loss_fn, optimizer)
        loss = validate_epoch(test_dataloader, model, loss_fn)
        session.report(dict(loss=loss))


def train_fashion_mnist(num_workers=1, use_gpu=True):
    trainer = TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config={"lr": 1e-3, "batch_size": 64, "epochs": 1},  # test-only: "epochs": 50
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
    )
    result = trainer.fit()
    print(f"Last result: {result.metrics}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--address", required=False, type=str, help="the address to use for Ray"
    )
    parser.add_argument(
        "--num-workers",
        "-n",
        type=int,
        default=20,
        help="Sets number of workers for training.",
    )
    parser.add_argument(
        "--use-gpu", action="store_true", default=False, help="Enables GPU training"
    )
    parser.add_argument(
        "--smoke-test",
        action="store_true",
        default=False,
        help="Finish quickly for testing.",
    )

    args, _ = parser.parse_known_args()

    import ray
    if args.smoke_test:
        # 2 workers + 1 for trainer.
        ray.init(num_cpus=3)
        train_fashion_mnist()
    elif args.address == "none":  # test-only: without Ray, lockstep runs its own worker processes
        train_fashion_mnist(num_workers=args.num_workers, use_gpu=args.use_gpu)  # test-only
    else:
        ray.init(address=args.address)
        train_fashion_mnist(num_workers=args.num_workers, use_gpu=args.use_gpu)
