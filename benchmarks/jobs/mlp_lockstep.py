"""Seed 003's job on lockstep (on Ray Train with ``--ray``; on lockstep's Ray executor with
``--lockstep-on-ray``), for benchmarks/bench_jobs.py and benchmarks/ray_bench.py.

The MLP of examples/fashion_mnist_mlp.py (784-512-128-64-10, LogSoftmax), SGD lr 1e-3, global
batch 64 (64 / world size per worker), the 60,000 training images in order (no shuffling, as
in the seed), 1 epoch, then validation on the 10,000 test images; ``report()`` once per epoch.
Each worker reads Fashion-MNIST itself (torchvision ``FashionMNIST`` + ``ToTensor``,
``DataLoader(num_workers=0)``), exactly like benchmarks/jobs/mlp_torchrun.py, whose model and
loop are the same code (jobs/mlp_common.py).

    python benchmarks/jobs/mlp_lockstep.py --data-dir /work/shared/data --num-workers 2
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from mlp_common import NeuralNetwork, load_data, stamp, train_epoch, validate_epoch  # torchvision, as seed 003
from on_ray import add_ray_flags, join_ray_if_asked
from torch import nn
from torch.utils.data import DataLoader

# As users write scripts: torch and torchvision (above) before lockstep or Ray Train.
if "--ray" in sys.argv:  # the same script on Ray Train: only the imports change
    from ray.train import RunConfig, ScalingConfig, get_context, report
    from ray.train.torch import TorchTrainer, prepare_data_loader, prepare_model
else:
    from lockstep import RunConfig, ScalingConfig, get_context, report
    from lockstep.torch import TorchTrainer, prepare_data_loader, prepare_model


# -- lockstep / Ray Train ----------------------------------------------------------------------


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    """Runs on every worker."""
    stamp("train function starts")
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
        stamp("training starts")
        train_epoch(train_loader, model, loss_fn, optimizer, world_size)
        stamp("training ends")
        loss = validate_epoch(test_loader, model, loss_fn, world_size)
        stamp("validation ends")
        report({"loss": loss})
    return {"loss": loss}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="Fashion-MNIST root (torchvision layout)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training images")
    parser.add_argument("--storage-path", default="/tmp/bench_jobs_runs", help="where runs are kept")
    add_ray_flags(parser)
    return parser.parse_args(argv)


def main() -> None:
    stamp("imports done")
    args = parse_args()
    started = time.perf_counter()
    if args.ray:
        import cloudpickle
        import mlp_common

        cloudpickle.register_pickle_by_value(mlp_common)  # Ray workers don't get this folder on their path
    join_ray_if_asked(args)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "lr": 1e-3,
            "batch_size": 64,
            "epochs": args.epochs,
            "data_dir": args.data_dir,
            "limit": args.limit,
        },
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
        run_config=RunConfig(storage_path=args.storage_path),
    )
    stamp("fit starts")
    result = trainer.fit()
    stamp("fit returns")
    print(f"Last result: {result.metrics}; fit {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
