"""A rank's shard of a ``ray.data.Dataset``: Ray's own ``DataIterator``, read with every one of
Ray's arguments, with ``device="auto"`` meaning this worker's device as it does in Ray Train."""

from __future__ import annotations

from typing import Any

__all__ = ["RayDataShard", "is_ray_data_iterator"]


def is_ray_data_iterator(value: Any) -> bool:
    """Whether ``value`` is a ``ray.data.DataIterator`` (checked without importing Ray)."""
    return any(cls.__name__ == "DataIterator" and cls.__module__.startswith("ray.data") for cls in type(value).__mro__)


class RayDataShard:
    """This rank's ``ray.data.DataIterator`` (a streaming split of the dataset), as
    ``get_dataset_shard`` returns it.

    Every attribute and method is the iterator's own, called with the arguments given. The one
    difference: ``iter_torch_batches(device="auto")``, Ray's default, puts batches on this
    worker's device (its GPU when it has one). Ray decides "auto" by asking whether it runs in a
    Ray Train worker, which lockstep's workers are not, so it would always choose the CPU.

    Example::

        shard = lockstep.get_dataset_shard("train")
        for batch in shard.iter_torch_batches(batch_size=32, local_shuffle_buffer_size=256, local_shuffle_seed=0):
            ...
    """

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator

    def iter_torch_batches(self, **kwargs: Any) -> Any:
        """Ray's ``DataIterator.iter_torch_batches`` with these arguments (all keyword-only, as
        in Ray), the default ``device="auto"`` being this worker's device."""
        from lockstep._internal.rank.torch_devices import get_device

        if kwargs.get("device", "auto") == "auto":
            kwargs["device"] = get_device()
        return self.iterator.iter_torch_batches(**kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "iterator":  # not set yet (while unpickling): don't recurse
            raise AttributeError(name)
        return getattr(self.iterator, name)

    def __repr__(self) -> str:
        return f"RayDataShard({self.iterator!r})"
