"""Equal, disjoint shards of map-style datasets, one per rank."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset


class DatasetShard(Dataset):
    """Rank ``rank``'s part of a map-style dataset: a contiguous block of
    ``len(dataset) // world_size`` items (the remainder is dropped so every rank gets as many
    items, and steps stay in lockstep).

    It is itself a map-style dataset (``len``, indexing), so it can go into a ``DataLoader``,
    and it offers Ray Data's ``iter_batches`` / ``iter_torch_batches``.
    """

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(
                f"datasets= values must be map-style datasets (with __len__ and __getitem__); "
                f"got {type(dataset).__name__}."
            )
        per_rank = len(dataset) // world_size
        self.dataset = dataset
        self.start = rank * per_rank
        self.length = per_rank

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if not -self.length <= index < self.length:
            raise IndexError(f"index {index} out of range for a shard of {self.length} items")
        return self.dataset[self.start + index % self.length]

    def iter_batches(
        self,
        *,
        batch_size: int = 256,
        shuffle: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Iterator[Any]:
        """Yield batches of this shard, collated like a DataLoader does."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        loader = DataLoader(
            self, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
            collate_fn=collate_fn, generator=generator,
        )
        yield from loader

    def iter_torch_batches(
        self,
        *,
        batch_size: int = 256,
        shuffle: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        device: torch.device | str | None = None,
    ) -> Iterator[Any]:
        """Like :meth:`iter_batches`, with each batch moved to ``device`` (default: this rank's device)."""
        from lockstep.torch.train_loop_utils import get_device, move_to_device

        target = torch.device(device) if device is not None else get_device()
        for batch in self.iter_batches(
            batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, collate_fn=collate_fn
        ):
            yield move_to_device(batch, target)


def shard_datasets(datasets: Mapping[str, Any], rank: int, world_size: int, split: Callable[[str], bool]) -> dict[str, Any]:
    """Each dataset as this rank sees it: sharded when ``split(name)``, else whole."""
    return {
        name: DatasetShard(dataset, rank, world_size) if split(name) else dataset
        for name, dataset in datasets.items()
    }
