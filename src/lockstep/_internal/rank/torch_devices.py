"""A rank's devices, and moving batches onto them: what ``lockstep.torch.get_device`` and
``move_to_device`` are, kept outside the ``lockstep.torch`` package so that the data shards and
the backend's set-up use them without importing the trainer."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from lockstep._internal.rank.devices import cuda_visible_devices
from lockstep._internal.rank.session_state import current_session

__all__ = ["get_device", "get_devices", "move_to_device"]


def get_devices() -> list[torch.device]:
    """The devices of this worker: one ``cuda:i`` per GPU assigned to it, else ``[cpu]``.

    ``i`` is the GPU's position in ``CUDA_VISIBLE_DEVICES``, so the mapping is right even when
    several workers share a node's GPU list (and when GPUs are named by UUID).
    """
    session = current_session()
    gpu_ids = session.context.gpu_ids if session is not None else ()
    if not gpu_ids or not torch.cuda.is_available():
        return [torch.device("cpu")]
    visible = cuda_visible_devices()
    if visible is None:
        return [torch.device("cuda", int(gpu_id)) for gpu_id in gpu_ids]
    return [torch.device("cuda", visible.index(gpu_id)) for gpu_id in gpu_ids]


def get_device() -> torch.device:
    """This worker's device: its first GPU, or the CPU when it has none."""
    return get_devices()[0]


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it (inside tuples, lists, dicts, named tuples) on ``device``."""
    return _map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))


def _map_tensors(batch: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` rebuilt with ``function`` applied to each tensor in it."""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, Mapping):
        return _rebuilt_mapping(batch, {key: _map_tensors(value, function) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_tensors(item, function) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(item, function) for item in batch)
    return batch


def _rebuilt_mapping(batch: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """A mapping of ``batch``'s type holding ``items``: built from them when the type takes a
    dict, else a copy of ``batch`` refilled (a ``defaultdict`` keeps its default), else a dict."""
    try:
        return type(batch)(items)  # type: ignore[call-arg]
    except TypeError:
        if isinstance(batch, MutableMapping):
            refilled = copy.copy(batch)
            refilled.clear()
            refilled.update(items)
            return refilled
        return items
