"""GPU paths (nccl, device placement, copies on a side stream). They run only where CUDA is
available: on a lent GPU machine through benchmarks/gpu_check.sh; skipped elsewhere (CI)."""

from __future__ import annotations

import pytest
import torch

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def nccl_and_placement() -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lockstep.torch import get_device, prepare_data_loader, prepare_model

    device = get_device()
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    model = prepare_model(torch.nn.Linear(4, 2))
    inputs = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    loader = prepare_data_loader(DataLoader(TensorDataset(inputs), batch_size=8))
    batches = [batch for (batch,) in loader]
    lockstep.report(
        {
            "backend": dist.get_backend(),
            "device": str(device),
            "sum": total.item(),
            "model_device": str(next(model.parameters()).device),
            "batch_devices": sorted({str(batch.device) for batch in batches}),
            "batches_equal": torch.equal(torch.cat([batch.cpu() for batch in batches]), inputs),
            "visible": torch.cuda.device_count(),
        }
    )


@pytest.mark.timeout(180)
def test_one_gpu_worker_uses_nccl_and_its_device(tmp_path) -> None:
    result = TorchTrainer(
        nccl_and_placement,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(storage_path=str(tmp_path)),
    ).fit()
    metrics = result.metrics
    assert metrics["backend"] == "nccl" and metrics["device"] == "cuda:0" and metrics["sum"] == 1.0
    assert metrics["model_device"] == "cuda:0" and metrics["batch_devices"] == ["cuda:0"]
    assert metrics["batches_equal"], "batches copied on the side stream differ from the data"
    assert metrics["visible"] == 1, "a worker sees GPUs that are not its own"


@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_workers_each_get_their_own_gpu(tmp_path) -> None:
    result = TorchTrainer(
        nccl_and_placement,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
        run_config=RunConfig(storage_path=str(tmp_path)),
    ).fit()
    assert result.metrics["sum"] == 2.0 and result.metrics["device"] == "cuda:0"


def fsdp_on_gpus(config: dict) -> dict:
    """Rank 0 reports the kind of module prepare_model made and a training step's loss."""
    from lockstep.torch import prepare_model

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = prepare_model(model, parallel_strategy="fsdp", parallel_strategy_kwargs=config["kwargs"])
    device = lockstep.torch.get_device()
    loss = model(torch.randn(4, 8, device=device)).sum()
    loss.backward()
    lockstep.report({"kind": type(model).__name__, "loss": loss.item()})


@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    ("kwargs", "kind"), [({}, "FSDPSequential"), ({"sharding_strategy": None}, "FullyShardedDataParallel")]
)
def test_fsdp_on_two_gpus_fsdp2_and_ray_trains_fsdp1_arguments(tmp_path, kwargs: dict, kind: str) -> None:
    result = TorchTrainer(
        fsdp_on_gpus,
        train_loop_config={"kwargs": kwargs},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
        run_config=RunConfig(storage_path=str(tmp_path)),
    ).fit()
    assert result.metrics["kind"] == kind


@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_hang_around_an_nccl_collective_is_an_nccl_hang_error_naming_it(tmp_path) -> None:
    """Written without a GPU to run it on (see docs/failures.md): rank 1 stops in its data loop
    while rank 0's NCCL all-reduce waits for it; the flight recorder names the collective."""
    from test_hangs import train_steps

    trainer = TorchTrainer(
        train_steps,
        train_loop_config={"steps": 10_000, "stuck_rank": 1, "stuck_at": 20, "marker": str(tmp_path / "stuck_since")},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
        run_config=RunConfig(storage_path=str(tmp_path), failure_config=lockstep.FailureConfig(hang_timeout_s=5)),
    )
    with pytest.raises(lockstep.NCCLHangError) as raised:
        trainer.fit()
    assert list(raised.value.failures) == [1] and raised.value.failures[1].error_type == "Hang"
    assert "(waiting in torch collective nccl:all_reduce #" in str(raised.value)


def report_a_checkpoint_to_validate() -> None:
    import tempfile

    from lockstep import Checkpoint

    with tempfile.TemporaryDirectory() as folder:
        lockstep.report({"step": 0}, checkpoint=Checkpoint.from_directory(folder), validation=True)


def gpus_seen(checkpoint: lockstep.Checkpoint) -> dict:
    import os

    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "count": torch.cuda.device_count(),
        "sum": torch.ones(3, device="cuda").sum().item(),
    }


@pytest.mark.timeout(180)
def test_a_validation_gets_the_gpu_it_asks_for(tmp_path) -> None:
    """A validation asking for num_gpus=1 sees one GPU (the worker's, on a one-GPU machine) and
    computes on it (without num_gpus it sees none: tests/test_validation.py checks that)."""
    from lockstep import ValidationConfig

    result = TorchTrainer(
        report_a_checkpoint_to_validate,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(storage_path=str(tmp_path)),
        validation_config=ValidationConfig(gpus_seen, ray_remote_kwargs={"num_gpus": 1}),
    ).fit()
    ((_, metrics),) = result.best_checkpoints
    assert metrics["count"] == 1 and metrics["sum"] == 3.0 and metrics["visible"]
