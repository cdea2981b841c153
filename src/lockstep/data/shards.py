"""Equal, disjoint shards of map-style datasets, one per rank, read like Ray Data's shards."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch.utils.data import Dataset, default_collate

from lockstep.data import batching

__all__ = ["DatasetShard", "shard_datasets"]


class DatasetShard(Dataset):
    """Rank ``rank``'s part of a map-style dataset: a contiguous block of
    ``len(dataset) // world_size`` items (the remainder is dropped so every rank gets as many
    items, and steps stay in lockstep).

    It is itself a map-style dataset (``len``, indexing), so it can go into a ``DataLoader``,
    and it is read as a Ray Data shard is: :meth:`iter_rows`, :meth:`iter_batches` and
    :meth:`iter_torch_batches` take Ray Data's arguments, with the same meaning.

    Example::

        shard = lockstep.get_dataset_shard("train")
        for epoch in range(3):
            for images, labels in shard.iter_torch_batches(batch_size=64, local_shuffle_buffer_size=1000):
                ...  # tensors on this worker's device
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

    def iter_rows(self) -> Iterator[Any]:
        """Yield the shard's items one by one, in order."""
        for index in range(self.length):
            yield self[index]

    def iter_batches(
        self,
        *,
        prefetch_batches: int = 1,
        batch_size: int | None = 256,
        batch_format: str | None = "default",
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
    ) -> Iterable[Any]:
        """The batches of this shard: an iterable that can be read again (each pass makes the
        batches anew), as Ray's is.

        Args:
            prefetch_batches: How many batches a background thread makes ahead (0: none).
            batch_size: Items per batch; None for the whole shard as one batch.
            batch_format: ``"default"``: collated into tensors as a ``DataLoader`` does;
                ``"numpy"``: the same with numpy arrays; None: the list of items.
            drop_last: Leave out the last batch when it is smaller than ``batch_size``.
            local_shuffle_buffer_size: Shuffle through a buffer of this many items (at least
                ``batch_size``); None reads the shard in order.
            local_shuffle_seed: Seed of that shuffle: the same order on every call; None: a
                new order each time.

        Raises:
            ValueError: an unknown ``batch_format``, or a shuffle without ``batch_size``.
        """
        batching.check_batch_format(batch_format)
        batching.check_batching(batch_size, local_shuffle_buffer_size)
        return batching.Batches(
            lambda: self._batches(
                prefetch_batches=prefetch_batches,
                batch_size=batch_size,
                drop_last=drop_last,
                shuffle_buffer_size=local_shuffle_buffer_size,
                shuffle_seed=local_shuffle_seed,
                collate=lambda items: batching.format_batch(items, batch_format),
            )
        )

    def iter_torch_batches(
        self,
        *,
        prefetch_batches: int = 1,
        batch_size: int | None = 256,
        dtypes: torch.dtype | Mapping[str, torch.dtype] | None = None,
        device: torch.device | str | Literal["auto"] | None = "auto",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
        pin_memory: bool = False,
    ) -> Iterable[Any]:
        """The batches as tensors on ``device``: an iterable that can be read again, as
        :meth:`iter_batches`'s.

        Args:
            prefetch_batches, batch_size, drop_last, local_shuffle_buffer_size,
                local_shuffle_seed: As for :meth:`iter_batches`.
            dtypes: Cast the tensors: one dtype for all, or a dict of key -> dtype for dict
                items. Not with ``collate_fn`` (cast inside it instead).
            device: Where the batches go; ``"auto"`` (or None): this worker's device.
            collate_fn: Turns a list of items into a batch (default: as a ``DataLoader``
                does); the tensors in what it returns are moved to ``device``.
            pin_memory: Put the batches in pinned memory before they are copied to the GPU
                (ignored where there is no GPU).

        Raises:
            ValueError: both ``dtypes`` and ``collate_fn``; see also :meth:`iter_batches`.
        """
        from lockstep._internal.rank.torch_devices import get_device, move_to_device

        if collate_fn is not None and dtypes is not None:
            raise ValueError(
                "iter_torch_batches(): dtypes can't be used with collate_fn; cast the tensors inside collate_fn."
            )
        target = get_device() if device in ("auto", None) else torch.device(device)

        def collate(items: list[Any]) -> Any:
            batch = (
                collate_fn(items) if collate_fn is not None else batching.cast_dtypes(default_collate(items), dtypes)
            )
            return batching.pin(batch) if pin_memory else batch

        batching.check_batching(batch_size, local_shuffle_buffer_size)

        def batches_on_device() -> Iterator[Any]:
            batches = self._batches(
                prefetch_batches=prefetch_batches,
                batch_size=batch_size,
                drop_last=drop_last,
                shuffle_buffer_size=local_shuffle_buffer_size,
                shuffle_seed=local_shuffle_seed,
                collate=collate,
            )
            return (move_to_device(batch, target, non_blocking=pin_memory) for batch in batches)

        return batching.Batches(batches_on_device)

    def _batches(
        self,
        prefetch_batches: int,
        batch_size: int | None,
        drop_last: bool,
        shuffle_buffer_size: int | None,
        shuffle_seed: int | None,
        collate: Callable[[list[Any]], Any],
    ) -> Iterator[Any]:
        """Batches of this shard, each made by ``collate`` from its items, fetched ahead."""
        rows = batching.row_order(self.length, shuffle_buffer_size, batch_size, shuffle_seed)
        made = (
            collate(batching.items_of(self, indices)) for indices in batching.index_batches(rows, batch_size, drop_last)
        )
        return batching.prefetched(made, prefetch_batches)


def shard_datasets(
    datasets: Mapping[str, Any], rank: int, world_size: int, split: Callable[[str], bool]
) -> dict[str, Any]:
    """Each dataset as this rank sees it: sharded when ``split(name)``, else whole."""
    return {
        name: DatasetShard(dataset, rank, world_size) if split(name) else dataset for name, dataset in datasets.items()
    }
