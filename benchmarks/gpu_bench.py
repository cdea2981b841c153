"""Seed 000's ResNet18 on one GPU: training images/s with lockstep vs the same loop in plain PyTorch.

The model is seed 000's (torchvision ``resnet18(num_classes=10)`` with a 1-channel ``conv1``),
Adam lr 1e-3, batch 128, on synthetic Fashion-MNIST-shaped data (1x28x28 images, 10 classes;
the real files are not on a GPU machine) held in host memory, as a DataLoader delivers them.
Each set-up trains ``--warmup`` untimed then ``--steps`` timed steps (synchronised), ``--rounds``
times, alternating; medians. lockstep: ``TorchTrainer`` with 1 worker, ``use_gpu=True``,
``prepare_model`` and ``prepare_data_loader`` (batches copied on a side stream). Plain: the
same loop in this process with ``.to(device, non_blocking=True)``. Goal: lockstep >= 0.98 x plain.

    python benchmarks/gpu_bench.py [--rounds 3] [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL = 0.98
BATCH = 128


def build_model() -> Any:
    import torch
    from torchvision.models import resnet18

    model = resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
    return model


def make_loader(images: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(images, 1, 28, 28, generator=generator), torch.randint(0, 10, (images,), generator=generator)
    )
    return DataLoader(data, batch_size=BATCH, shuffle=True, pin_memory=True, drop_last=True)


def images_per_second(loader: Any, model: Any, device: Any, warmup: int, steps: int, move: bool) -> float:
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = iter(loader)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            started = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        if move:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    return steps * BATCH / (time.perf_counter() - started)


def lockstep_train(config: dict[str, Any]) -> float:
    from lockstep.torch import get_device, prepare_data_loader, prepare_model

    loader = prepare_data_loader(make_loader(config["images"]))
    model = prepare_model(build_model())
    return images_per_second(loader, model, get_device(), config["warmup"], config["steps"], move=False)


def plain_run(args: argparse.Namespace) -> float:
    import torch

    device = torch.device("cuda", 0)
    return images_per_second(
        make_loader(args.images), build_model().to(device), device, args.warmup, args.steps, move=True
    )


def lockstep_run(args: argparse.Namespace) -> float:
    from lockstep import RunConfig, ScalingConfig
    from lockstep.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as storage:
        result = TorchTrainer(
            lockstep_train,
            train_loop_config={"images": args.images, "warmup": args.warmup, "steps": args.steps},
            scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
            run_config=RunConfig(storage_path=storage),
        ).fit()
    return float(result.return_value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--images", type=int, default=60_000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    rates: dict[str, list[float]] = {"lockstep": [], "plain": []}
    for round_index in range(args.rounds):
        order = [("lockstep", lockstep_run), ("plain", plain_run)]
        for name, run in order if round_index % 2 == 0 else order[::-1]:
            rates[name].append(run(args))
            print(f"[round {round_index + 1}/{args.rounds}] {name}: {rates[name][-1]:.0f} images/s", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["lockstep"] / medians["plain"]
    print(
        f"\nGPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; ResNet18 1x28x28, batch {BATCH}, "
        f"{args.steps} timed steps x {args.rounds} rounds\n"
    )
    print("| set-up | images/s median | min | max |\n|---|---:|---:|---:|")
    for name, values in rates.items():
        print(f"| {name} | {medians[name]:.0f} | {min(values):.0f} | {max(values):.0f} |")
    print(f"| lockstep / plain (goal >= {GOAL}) | {ratio:.3f} | | {'PASS' if ratio >= GOAL else 'MISS'} |")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"rates": rates, "medians": medians, "ratio": ratio, "gpu": torch.cuda.get_device_name(0)})
        )


if __name__ == "__main__":
    main()
