"""Datasets read the Ray Data way: a ``ray.data.Dataset`` passed by a script that never called
``ray.init()`` runs on the Ray executor (one local Ray for the module, started by creating the
dataset, as in such a script), and both kinds of shard take Ray Data's ``iter_batches`` /
``iter_torch_batches`` arguments and ``get_dataset_shard(dataset_name=None)``."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import untagged

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep._internal.rank.worker_session import WorkerSession
from lockstep.data import DatasetShard
from lockstep.torch import TorchTrainer

pytestmark = pytest.mark.timeout(120)


def pairs(count: int) -> list[tuple[torch.Tensor, int]]:
    """A map-style dataset of (float tensor, int label) items."""
    return [(torch.tensor([float(index)]), index) for index in range(count)]


def labels(batches: Iterable[Any]) -> list[list[int]]:
    """The labels of each (features, labels) batch."""
    return [batch[1].tolist() for batch in batches]


# -- torch-dataset shards, no processes ---------------------------------------------------------


def test_torch_shard_batches_drop_last_and_batch_size_none() -> None:
    shard = DatasetShard(pairs(22), rank=1, world_size=2)  # items 11 … 21
    assert labels(shard.iter_batches(batch_size=4)) == [[11, 12, 13, 14], [15, 16, 17, 18], [19, 20, 21]]
    assert labels(shard.iter_torch_batches(batch_size=4, drop_last=True)) == [[11, 12, 13, 14], [15, 16, 17, 18]]
    assert labels(shard.iter_batches(batch_size=None, drop_last=True)) == [list(range(11, 22))]
    assert [item[1] for item in shard.iter_rows()] == list(range(11, 22))


def test_torch_shard_batches_can_be_read_again_as_rays_can() -> None:
    shard = DatasetShard(pairs(22), rank=1, world_size=2)
    for batches in (shard.iter_batches(batch_size=4), shard.iter_torch_batches(batch_size=4, prefetch_batches=2)):
        assert labels(batches) == labels(batches) == [[11, 12, 13, 14], [15, 16, 17, 18], [19, 20, 21]]
    unseeded = shard.iter_batches(batch_size=2, local_shuffle_buffer_size=11)
    assert len({str(labels(unseeded)) for _ in range(4)}) > 1, "each pass without a seed is a new order"


def test_torch_shard_local_shuffle_is_a_seeded_permutation_of_the_shard() -> None:
    shard = DatasetShard(pairs(80), rank=0, world_size=2)
    seeded = [
        labels(shard.iter_torch_batches(batch_size=8, local_shuffle_buffer_size=16, local_shuffle_seed=3))
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1], "the same seed gives the same order"
    flat = [label for batch in seeded[0] for label in batch]
    assert sorted(flat) == list(range(40)) and flat != list(range(40))
    other_seed = labels(shard.iter_torch_batches(batch_size=8, local_shuffle_buffer_size=16, local_shuffle_seed=4))
    assert other_seed != seeded[0]
    unseeded = {str(labels(shard.iter_batches(batch_size=8, local_shuffle_buffer_size=40))) for _ in range(4)}
    assert len(unseeded) > 1, "without a seed each epoch is shuffled anew"
    with pytest.raises(ValueError, match="needs a batch_size"):
        shard.iter_batches(batch_size=None, local_shuffle_buffer_size=8)


def test_torch_shard_dtypes_collate_fn_device_pin_memory_and_prefetch() -> None:
    shard = DatasetShard([{"x": torch.tensor([float(i)]), "y": i} for i in range(12)], rank=0, world_size=1)
    batch = next(iter(shard.iter_torch_batches(batch_size=4, dtypes={"x": torch.float64}, device="cpu")))
    assert batch["x"].dtype == torch.float64 and batch["y"].dtype == torch.int64
    everything = next(iter(shard.iter_torch_batches(batch_size=4, dtypes=torch.float16, pin_memory=True)))
    assert everything["x"].dtype == everything["y"].dtype == torch.float16
    assert everything["x"].device == lockstep.torch.get_device(), "device='auto' is this worker's device"

    def stack_x(items: list[dict]) -> torch.Tensor:
        return torch.stack([item["x"] for item in items]) * 2

    doubled = list(shard.iter_torch_batches(batch_size=6, collate_fn=stack_x, prefetch_batches=3))
    assert [batch.flatten().tolist() for batch in doubled] == [[0, 2, 4, 6, 8, 10], [12, 14, 16, 18, 20, 22]]
    with pytest.raises(ValueError, match="dtypes can't be used with collate_fn"):
        shard.iter_torch_batches(dtypes=torch.float32, collate_fn=stack_x)
    with pytest.raises(ValueError, match="names columns"):
        next(iter(DatasetShard(pairs(4), 0, 1).iter_torch_batches(dtypes={"x": torch.float64})))
    no_prefetch = [batch["y"].tolist() for batch in shard.iter_batches(batch_size=5, prefetch_batches=0)]
    prefetched = [batch["y"].tolist() for batch in shard.iter_batches(batch_size=5, prefetch_batches=4)]
    assert no_prefetch == prefetched == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]


def test_torch_shard_batch_formats() -> None:
    shard = DatasetShard(pairs(6), rank=0, world_size=1)
    features, numbers = next(iter(shard.iter_batches(batch_size=3, batch_format="numpy")))
    assert isinstance(features, np.ndarray) and numbers.tolist() == [0, 1, 2]
    assert [item[1] for item in next(iter(shard.iter_batches(batch_size=3, batch_format=None)))] == [0, 1, 2]
    with pytest.raises(ValueError, match="pass a ray.data.Dataset to get 'pandas'"):
        shard.iter_batches(batch_format="pandas")


def test_a_broken_dataset_raises_where_its_batch_is_read() -> None:
    class Broken(list):
        def __getitem__(self, index: int) -> Any:
            if index == 5:
                raise RuntimeError("item 5 is unreadable")
            return super().__getitem__(index)

    batches = iter(DatasetShard(Broken(range(8)), 0, 1).iter_batches(batch_size=2, prefetch_batches=2))
    assert next(batches).tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="item 5 is unreadable"):
        list(batches)


def test_dataset_name_none_means_the_only_dataset() -> None:
    one = WorkerSession(None, None, 0, None, {"train": [1, 2]})  # type: ignore[arg-type]
    assert one.get_dataset_shard() == one.get_dataset_shard("train") == [1, 2]
    two = WorkerSession(None, None, 0, None, {"train": [1], "valid": [2]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly one dataset, but the trainer got: 'train', 'valid'"):
        two.get_dataset_shard()
    with pytest.raises(KeyError, match="no such dataset"):
        two.get_dataset_shard("test")


def read_torch_shard_with_ray_arguments() -> None:
    shard = lockstep.get_dataset_shard()
    batches = list(
        shard.iter_torch_batches(
            prefetch_batches=2,
            batch_size=4,
            dtypes=torch.float64,
            device="auto",
            collate_fn=None,
            drop_last=True,
            local_shuffle_buffer_size=8,
            local_shuffle_seed=lockstep.get_context().get_world_rank(),
            pin_memory=False,
        )
    )
    lockstep.report({"labels": [batch[1].tolist() for batch in batches], "dtype": str(batches[0][0].dtype)})


def test_torch_shard_in_a_run_takes_ray_arguments(storage_path: str) -> None:
    result = TorchTrainer(
        read_torch_shard_with_ray_arguments,
        datasets={"train": pairs(20)},
        scaling_config=ScalingConfig(num_workers=2, executor="local"),
        run_config=RunConfig(storage_path=storage_path),
    ).fit()
    rank0 = [label for batch in result.metrics["labels"] for label in batch]
    assert len(result.metrics["labels"]) == 2, "10 items in batches of 4 with drop_last"
    assert len(set(rank0)) == 8 and set(rank0) <= set(range(10)), "rank 0 reads its own half only"
    assert rank0 != sorted(rank0), "the local shuffle buffer reorders the items"
    assert result.metrics["dtype"] == "torch.float64"


# -- Ray Datasets, without ray.init() -----------------------------------------------------------


@pytest.fixture(scope="module")
def ray_dataset() -> Iterator[Any]:
    """A Ray Dataset made as a script makes one without calling ``ray.init()``: creating it
    starts a local Ray, which is shut down after the module."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process; this module needs a process without it")
    with untagged():
        dataset = ray.data.from_items([{"x": float(index), "id": index} for index in range(64)])
    try:
        assert ray.is_initialized(), "creating a Ray Dataset is expected to start Ray"
        yield dataset
    finally:
        ray.shutdown()


def read_ray_shard_with_ray_arguments() -> None:
    import ray
    from ray.data.collate_fn import NumpyBatchCollateFn

    class Doubled(NumpyBatchCollateFn):
        def __call__(self, batch: dict) -> torch.Tensor:
            return torch.as_tensor(batch["x"] * 2)

    shard = lockstep.get_dataset_shard()  # dataset_name=None: the only dataset
    torch_batches = list(
        shard.iter_torch_batches(
            prefetch_batches=2,
            batch_size=8,
            dtypes={"x": torch.float16, "id": torch.int64},
            device="auto",
            drop_last=True,
            local_shuffle_buffer_size=16,
            local_shuffle_seed=1,
            pin_memory=False,
        )
    )
    numpy_ids = [
        int(value)
        for batch in shard.iter_batches(prefetch_batches=0, batch_size=5, batch_format="numpy", drop_last=False)
        for value in batch["id"]
    ]
    collated = list(shard.iter_torch_batches(batch_size=32, collate_fn=Doubled()))
    lockstep.report(
        {
            "on_ray_actor": ray.get_runtime_context().get_actor_id() is not None,
            "iterator": type(shard.iterator).__name__,
            "dtype": str(torch_batches[0]["x"].dtype),
            "device": str(torch_batches[0]["x"].device),
            "shuffled_ids": [int(value) for batch in torch_batches for value in batch["id"]],
            "numpy_ids": numpy_ids,
            "collated_sum": float(sum(batch.sum() for batch in collated)),
        }
    )


def test_ray_dataset_without_ray_init_runs_on_ray_with_ray_arguments(
    ray_dataset: Any, storage_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="lockstep"):
        result = TorchTrainer(
            read_ray_shard_with_ray_arguments,
            datasets={"train": ray_dataset},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=storage_path),
        ).fit()
    assert (
        "datasets ['train'] are Ray Datasets: running on Ray (a local Ray instance this process started)" in caplog.text
    )
    metrics = result.metrics
    assert metrics["on_ray_actor"], "Ray Datasets run on the Ray executor"
    assert "DataIterator" in metrics["iterator"], "the shard is Ray's own iterator, called with Ray's arguments"
    assert metrics["dtype"] == "torch.float16" and metrics["device"] == "cpu"
    assert len(metrics["numpy_ids"]) == 32, "rank 0 reads its half of the streaming split"
    assert sorted(metrics["shuffled_ids"]) == sorted(metrics["numpy_ids"]), "drop_last leaves whole batches only"
    assert metrics["shuffled_ids"] != metrics["numpy_ids"], "the local shuffle buffer reorders the rows"
    assert metrics["collated_sum"] == 2 * sum(float(index) for index in metrics["numpy_ids"])
