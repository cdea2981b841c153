"""Ray Train's "Get Started with PyTorch Lightning" on lockstep: a LightningModule trained on
Fashion-MNIST by N workers with DDP, validation loss and accuracy every epoch, the two best
checkpoints kept, and the best model reloaded with ``load_from_checkpoint``.

    python examples/lightning_fashion_mnist.py --num-workers 2 --epochs 2

Moving the Ray Train script here took only its imports: ``ray.train`` became ``lockstep``,
``ray.train.torch`` became ``lockstep.torch`` and ``ray.train.lightning`` became
``lockstep.lightning``. (The guide's ResNet18 is swapped for a small MLP so that it runs in under
a minute on two CPUs; ``import pytorch_lightning as pl`` works as well.)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import Compose, Normalize, ToTensor

import lockstep
from lockstep import CheckpointConfig, RunConfig, ScalingConfig
from lockstep.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from lockstep.torch import TorchTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist_data import load_fashion_mnist, resolve_data_dir, subset  # noqa: E402


class ImageClassifier(pl.LightningModule):
    """A 784 -> 256 -> 10 MLP with Adam; logs training loss, validation loss and accuracy."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 256), nn.ReLU(), nn.Linear(256, 10))
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.criterion(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", self.criterion(logits, y), sync_dist=True)
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def fashion_mnist_loaders(config: dict[str, Any]) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders (Lightning gives each worker its own part of them)."""
    transform = Compose([ToTensor(), Normalize((0.28604,), (0.32025,))])
    train_data = subset(load_fashion_mnist(config["data_dir"], train=True, transform=transform), config["limit"])
    val_data = subset(load_fashion_mnist(config["data_dir"], train=False, transform=transform), config["limit"])
    batch_size = config["batch_size"]
    return DataLoader(train_data, batch_size=batch_size, shuffle=True), DataLoader(val_data, batch_size=batch_size)


def train_func(config: dict[str, Any]) -> None:
    """Runs on every worker: the guide's Lightning loop, unchanged but for the model."""
    model = ImageClassifier(lr=config["lr"])
    train_dataloader, val_dataloader = fashion_mnist_loaders(config)
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        devices="auto",
        accelerator="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(model, train_dataloaders=train_dataloader, val_dataloaders=val_dataloader)


def train_fashion_mnist(args: argparse.Namespace) -> lockstep.Result:
    """Train with lockstep and return the Result."""
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "lr": args.lr,
            "batch_size": 128,
            "epochs": args.epochs,
            "data_dir": resolve_data_dir(args.data_dir),
            "limit": 2000 if args.smoke_test else None,
        },
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        run_config=RunConfig(
            storage_path=args.storage_path,
            name=args.name,
            checkpoint_config=CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val_accuracy", checkpoint_score_order="max"
            ),
        ),
    )
    return trainer.fit()


def best_model(result: lockstep.Result) -> tuple[ImageClassifier, dict[str, Any]]:
    """The kept checkpoint with the highest validation accuracy, loaded, and its metrics."""
    checkpoint, metrics = max(result.best_checkpoints, key=lambda pair: pair[1]["val_accuracy"])
    with checkpoint.as_directory() as folder:
        model = ImageClassifier.load_from_checkpoint(os.path.join(folder, RayTrainReportCallback.CHECKPOINT_NAME))
    return model, metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", "-n", type=int, default=2, help="number of workers")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--smoke-test", action="store_true", help="2,000 images, for a quick check")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST root (default: $LOCKSTEP_DATA, else ~/data)")
    parser.add_argument("--storage-path", default=None, help="where runs are kept (default ~/lockstep_results)")
    parser.add_argument("--name", default=None, help="run name (default: TorchTrainer_<time>)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    result = train_fashion_mnist(args)
    print(f"Last result: {result.metrics}")
    model, metrics = best_model(result)
    print(f"Best checkpoint: epoch {metrics['epoch']}, validation accuracy {100 * metrics['val_accuracy']:.1f}%")
    print(f"Reloaded {type(model).__name__} with {sum(p.numel() for p in model.parameters())} parameters")
    print(f"Run folder: {result.path}")


if __name__ == "__main__":
    main()
