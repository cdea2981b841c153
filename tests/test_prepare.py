"""prepare_model / prepare_data_loader in real 2-worker runs, and DDP against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler, TensorDataset

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer, prepare_data_loader, prepare_model

pytestmark = pytest.mark.timeout(120)

SAMPLES, FEATURES, PER_WORKER_BATCH, STEPS = 64, 8, 4, 5


def _regression_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = inputs @ torch.randn(FEATURES, 1, generator=generator) + 0.1
    return TensorDataset(inputs, targets)


def _fresh_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(model: nn.Module, loader: DataLoader, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (inputs, targets) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def ddp_train() -> list[torch.Tensor]:
    model = prepare_model(_fresh_model())
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    loader = prepare_data_loader(DataLoader(_regression_data(), batch_size=PER_WORKER_BATCH, shuffle=False))
    _train(model, loader, STEPS)
    return [parameter.detach().clone() for parameter in model.module.parameters()]


def test_two_ddp_workers_match_one_process_with_double_batch(storage_path: str) -> None:
    result = TorchTrainer(
        ddp_train,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="ddp", storage_path=storage_path),
    ).fit()
    reference = _fresh_model()
    _train(reference, DataLoader(_regression_data(), batch_size=2 * PER_WORKER_BATCH, shuffle=False), STEPS)
    untrained = list(_fresh_model().parameters())
    for got, expected, start in zip(result.return_value, reference.parameters(), untrained, strict=True):
        assert not torch.allclose(expected, start)
        torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)


class Numbers(IterableDataset):
    def __iter__(self):
        return iter(range(6))


def _seed_worker(worker_id: int) -> None:
    torch.manual_seed(worker_id)


def _collate_doubled(items: list[int]) -> torch.Tensor:
    return torch.tensor(items) * 2


def inspect_loaders() -> dict:
    dataset = list(range(20))
    rank = lockstep.get_context().get_world_rank()
    shuffled = prepare_data_loader(
        DataLoader(
            dataset,
            batch_size=3,
            shuffle=True,
            drop_last=True,
            collate_fn=_collate_doubled,
            worker_init_fn=_seed_worker,
        )
    )
    epochs = []
    for epoch in range(2):
        shuffled.sampler.set_epoch(epoch)
        epochs.append([int(item) // 2 for batch in shuffled for item in batch])
    ordered = prepare_data_loader(DataLoader(dataset, batch_size=5, shuffle=False))
    own_sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False, seed=7)
    kept = prepare_data_loader(DataLoader(dataset, batch_size=5, sampler=own_sampler))
    iterable = prepare_data_loader(DataLoader(Numbers(), batch_size=2))
    unbatched = prepare_data_loader(DataLoader(dataset, batch_size=None, shuffle=False))
    mine = {
        "epochs": epochs,
        "sampler": isinstance(shuffled.sampler, DistributedSampler),
        "shuffle": shuffled.sampler.shuffle,
        "settings": [
            shuffled.batch_size,
            shuffled.drop_last,
            shuffled.collate_fn is _collate_doubled,
            shuffled.worker_init_fn is _seed_worker,
        ],
        "ordered": [int(item) for batch in ordered for item in batch],
        "ordered_shuffle": ordered.sampler.shuffle,
        "kept_sampler": kept.sampler is own_sampler,
        "iterable": [batch.tolist() for batch in iterable],
        "iterable_sampler": type(iterable.sampler).__name__,
        "unbatched": [int(item) for item in unbatched],
        "settings_kept": [shuffled.num_workers, shuffled.pin_memory, shuffled.timeout, shuffled.persistent_workers],
    }
    gathered: list[object] = [None] * 2
    dist.all_gather_object(gathered, mine)
    return {"ranks": gathered}


def test_prepare_data_loader_shards_and_keeps_settings(storage_path: str) -> None:
    result = TorchTrainer(
        inspect_loaders,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="loaders", storage_path=storage_path),
    ).fit()
    first, second = result.return_value["ranks"]
    for rank in (first, second):
        assert rank["sampler"] is True and rank["shuffle"] is True
        assert rank["settings"] == [3, True, True, True]
        assert rank["ordered_shuffle"] is False
        assert rank["kept_sampler"] is True
        assert rank["iterable"] == [[0, 1], [2, 3], [4, 5]]
        assert rank["iterable_sampler"] != "DistributedSampler"
        assert rank["settings_kept"] == [0, False, 0, False]
        assert len(rank["unbatched"]) == 10
        assert len(rank["epochs"][0]) == 9
        assert rank["epochs"][0] != rank["epochs"][1]
    assert not set(first["epochs"][0]) & set(second["epochs"][0])
    assert sorted(first["ordered"] + second["ordered"]) == list(range(20))
    assert not set(first["ordered"]) & set(second["ordered"])
    assert first["ordered"] == list(range(0, 20, 2))
    assert sorted(first["unbatched"] + second["unbatched"]) == list(range(20))


def test_single_process_helpers_leave_things_alone() -> None:
    model = nn.Linear(2, 1)
    assert prepare_model(model) is model
    loader = DataLoader(list(range(4)), batch_size=2)
    assert prepare_data_loader(loader) is loader
    assert isinstance(loader.sampler, SequentialSampler)
    with pytest.raises(ValueError, match="parallel_strategy"):
        prepare_model(model, parallel_strategy="zero3")
    assert prepare_model(model, parallel_strategy="fsdp") is model, "one worker: nothing to shard"
    assert lockstep.torch.get_devices() == [torch.device("cpu")]


def test_move_to_device_walks_nested_batches() -> None:
    from collections import namedtuple

    from lockstep.torch import move_to_device

    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.zeros(1), (torch.ones(1), "label")], "b": Pair(torch.ones(2), 3)}
    moved = move_to_device(batch, torch.device("cpu"))
    assert isinstance(moved["b"], Pair) and moved["b"].y == 3
    assert moved["a"][1][1] == "label" and isinstance(moved["a"][1], tuple)
    torch.testing.assert_close(moved["a"][1][0], torch.ones(1))
