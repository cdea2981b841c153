"""``prepare_model(parallel_strategy="fsdp")`` on CPU: FSDP2 shards the model across real gloo
ranks; its model and optimizer state go into a checkpoint with torch.distributed.checkpoint
(DCP) through ``report()``, and a rerun on 3 ranks resumes from it, resharded, with the
parameters and the optimizer state that were saved."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer, prepare_model
from lockstep.torch.sharding import shard_model

REFERENCE = "full_reference.pt"


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )


def full_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole model and optimizer state, gathered on rank 0 (empty on the others)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=whole)
    return {"model": model_state, "optim": optimizer_state}


def local_shapes(model: torch.nn.Module) -> dict[str, tuple[list[int], list[int]]]:
    """Each parameter's (local shard shape, full shape) on this rank."""
    return {name: (list(param.to_local().shape), list(param.shape)) for name, param in model.named_parameters()}


def sharded_train_func(config: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = lockstep.get_context().get_world_rank()
    model = prepare_model(small_model(), parallel_strategy="fsdp")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, local_shapes(model))
    start = lockstep.get_checkpoint()
    if start is not None:  # the rerun: load the DCP checkpoint, resharded onto this world size
        with start.as_directory() as folder:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optimizer_state}
            dcp.load(state, checkpoint_id=folder)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            loaded = full_states(model, optimizer)
            saved = torch.load(os.path.join(folder, REFERENCE), weights_only=False) if rank == 0 else None
        return {"shapes": shapes, "resumed": True, "same": rank != 0 or _equal(loaded, saved)}
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    reference = full_states(model, optimizer)
    with tempfile.TemporaryDirectory() as folder:
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=folder)
        if rank == 0:
            torch.save(reference, os.path.join(folder, REFERENCE))
        lockstep.report({"loss": loss.item()}, checkpoint=Checkpoint.from_directory(folder))
    return {"shapes": shapes, "resumed": False}


def _equal(loaded: Any, saved: Any) -> bool:
    """Whether two nested state dicts hold the same keys and equal tensors."""
    if isinstance(loaded, dict):
        return (
            isinstance(saved, dict)
            and loaded.keys() == saved.keys()
            and all(_equal(loaded[key], saved[key]) for key in loaded)
        )
    if isinstance(loaded, torch.Tensor):
        return isinstance(saved, torch.Tensor) and torch.equal(loaded, saved)
    return loaded == saved


def fit_sharded(storage_path: str, workers: int) -> lockstep.Result:
    return TorchTrainer(
        sharded_train_func,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name="sharded", storage_path=storage_path, verbose=0),
    ).fit()


def assert_sharded(shapes: list[dict[str, tuple[list[int], list[int]]]], workers: int) -> None:
    """Every rank holds a shard of each parameter (rows split along dim 0), not a copy."""
    assert len(shapes) == workers
    for name, (_, full) in shapes[0].items():
        rows = [rank_shapes[name][0][0] if rank_shapes[name][0] else 0 for rank_shapes in shapes]
        assert sum(rows) == full[0], f"{name}: the shards' rows {rows} don't add up to {full[0]}"
        if full[0] >= workers:
            assert max(rows) < full[0], f"{name} is whole on a rank: not sharded"


@pytest.mark.timeout(240)
def test_fsdp_on_cpu_saves_with_dcp_and_resumes_resharded_on_3_ranks(storage_path: str) -> None:
    first = fit_sharded(storage_path, 2)
    assert first.error is None and first.checkpoint is not None
    assert_sharded(first.return_value["shapes"], 2)
    files = sorted(os.listdir(first.checkpoint.path))
    assert ".metadata" in files and len([name for name in files if name.endswith(".distcp")]) == 2, files
    second = fit_sharded(storage_path, 3)
    assert second.return_value["resumed"], "the rerun did not start from the checkpoint"
    assert_sharded(second.return_value["shapes"], 3)
    assert second.return_value["same"], "the resharded model or optimizer state differs from what was saved"


def test_fsdp1_arguments_on_cpu_say_what_to_pass_instead() -> None:
    with pytest.raises(ValueError, match=r"sharding_strategy are arguments of torch's FSDP1 .*fully_shard"):
        shard_model(small_model(), torch.device("cpu"), {"sharding_strategy": "FULL_SHARD"})
    with pytest.raises(ValueError, match="not arguments of torch.distributed.fsdp.fully_shard"):
        shard_model(small_model(), torch.device("cpu"), {"shard_everything": True})
