"""Helpers used inside the train function: devices, model wrapping, data loader sharding."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lockstep._internal.rank.progress import count_forward_passes
from lockstep._internal.rank.session_state import current_session
from lockstep._internal.rank.step_timing import timed_batches, with_all_reduce_timing
from lockstep._internal.rank.torch_devices import _map_tensors, get_device, get_devices, move_to_device
from lockstep._internal.ray_compat.deprecated import removed_function
from lockstep.torch.data_order import EpochTrackingSampler, ResumableDataLoader
from lockstep.torch.sharding import shard_model

logger = logging.getLogger(__name__)

__all__ = [
    "accelerate",
    "backward",
    "enable_reproducibility",
    "get_device",
    "get_devices",
    "move_to_device",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
]

PARALLEL_STRATEGIES = ("ddp", "fsdp", None)


# -- devices: lockstep._internal.rank.torch_devices ---------------------------------------------------


def _world() -> tuple[int, int]:
    """(rank, world size) from the session, else from torch.distributed, else (0, 1)."""
    session = current_session()
    if session is not None:
        return session.context.world_rank, session.context.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# -- model ---------------------------------------------------------------------------------------


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Put the model on this worker's device and wrap it for data-parallel training.

    Args:
        model: The model.
        move_to_device: True for this worker's device, a ``torch.device`` for that one, False to
            leave the model where it is.
        parallel_strategy: ``"ddp"`` (DistributedDataParallel), ``"fsdp"`` (sharded with FSDP2's
            ``fully_shard``, on CPU and GPUs; FSDP1's arguments keep FSDP1 on GPUs: see
            :mod:`lockstep.torch.sharding`) or None. Only applied when there is more than one worker.
        parallel_strategy_kwargs: Extra arguments for DDP, ``fully_shard`` (or FSDP1).

    Returns:
        The model, wrapped when the world size is above 1.
    """
    if parallel_strategy not in PARALLEL_STRATEGIES:
        raise ValueError(f"prepare_model: parallel_strategy={parallel_strategy!r}; choose 'ddp', 'fsdp' or None.")
    device = move_to_device if isinstance(move_to_device, torch.device) else get_device()
    if move_to_device is not False:
        model = model.to(device)
    count_forward_passes(model)  # progress for the hang detector, through a wrapper or not (model.module)
    _, world_size = _world()
    if world_size <= 1 or parallel_strategy is None:
        return model
    return _wrap(model, device, parallel_strategy, dict(parallel_strategy_kwargs or {}))


def _wrap(model: torch.nn.Module, device: torch.device, strategy: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    """The model wrapped for ``strategy``."""
    if strategy == "ddp":
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device])
            kwargs.setdefault("output_device", device)
        wrapped = with_all_reduce_timing(DistributedDataParallel(model, **kwargs))
    else:
        wrapped = shard_model(model, device, kwargs)
    return wrapped


# -- data loader ---------------------------------------------------------------------------------


def prepare_data_loader(
    data_loader: DataLoader,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
) -> DataLoader | DeviceDataLoader:
    """Shard a DataLoader across workers and move its batches to this worker's device.

    A ``DistributedSampler`` is added only when there is more than one worker, the loader has
    no distributed sampler yet and its dataset is not an ``IterableDataset``. Shuffling is kept
    (a ``SequentialSampler`` stays in order, anything else shuffles) and so is every other
    setting of the loader.

    A loader over a ``DistributedSampler`` (added here or the caller's own) comes back as a
    :class:`~lockstep.torch.data_order.ResumableDataLoader`: each new pass uses the sampler's
    next epoch unless ``loader.sampler.set_epoch(epoch)`` chose one, and ``state_dict()`` /
    ``load_state_dict()`` save and restore the epoch and the position in it.

    Args:
        data_loader: The loader, with the per-worker batch size.
        add_dist_sampler: Whether to shard it.
        move_to_device: Move each batch to :func:`get_device` (a no-op on CPU).
        auto_transfer: On CUDA, copy the next batch on a side stream while the current one trains.
    """
    data_loader = _sharded(data_loader, add_dist_sampler)
    device = get_device()
    if move_to_device and device.type != "cpu":
        return DeviceDataLoader(data_loader, device, auto_transfer=auto_transfer)
    return data_loader


def _sharded(loader: DataLoader, add_dist_sampler: bool) -> DataLoader:
    """``loader`` with this worker's share of the data, resumable where it has a DistributedSampler."""
    rank, world_size = _world()
    if isinstance(loader, ResumableDataLoader):
        return loader
    if add_dist_sampler and world_size > 1 and _needs_sampler(loader):
        return _with_distributed_sampler(loader, rank, world_size)
    if _resumable_as_it_is(loader):
        return ResumableDataLoader(loader.dataset, sampler=loader.sampler, **_loader_settings(loader))
    if (
        _reproducible_seed is not None
        and loader.batch_size is not None
        and not isinstance(loader.dataset, IterableDataset)
    ):
        return DataLoader(loader.dataset, sampler=loader.sampler, **_loader_settings(loader))
    return loader


def _needs_sampler(loader: DataLoader) -> bool:
    if isinstance(loader.dataset, IterableDataset):
        return False
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    if any(isinstance(sampler, DistributedSampler) for sampler in samplers):
        return False
    if loader.batch_size is None and loader.batch_sampler is not None:
        logger.warning(
            "prepare_data_loader: the loader has a custom batch_sampler (%s); it is left as it is, "
            "so each worker sees all of it. Shard it yourself or pass batch_size= instead.",
            type(loader.batch_sampler).__name__,
        )
        return False
    return True


def _resumable_as_it_is(loader: DataLoader) -> bool:
    """A plain DataLoader over a DistributedSampler, batched by batch_size or not at all."""
    default_batching = loader.batch_size is not None or loader.batch_sampler is None
    return type(loader) is DataLoader and isinstance(loader.sampler, DistributedSampler) and default_batching


def _with_distributed_sampler(loader: DataLoader, rank: int, world_size: int) -> DataLoader:
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        logger.warning(
            "prepare_data_loader: replacing the loader's %s with a shuffling DistributedSampler; "
            "pass add_dist_sampler=False to keep it.",
            type(loader.sampler).__name__,
        )
    shuffle = not isinstance(loader.sampler, SequentialSampler)
    sampler = EpochTrackingSampler(
        loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=_reproducible_seed or 0
    )
    return ResumableDataLoader(loader.dataset, sampler=sampler, **_loader_settings(loader))


def _loader_settings(loader: DataLoader) -> dict[str, Any]:
    """Every setting of ``loader`` except its dataset and sampler."""
    settings: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    if _reproducible_seed is not None:
        settings["generator"] = loader.generator or torch.Generator().manual_seed(_reproducible_seed)
        settings["worker_init_fn"] = _SeededWorkerInit(loader.worker_init_fn)
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    return settings


class DeviceDataLoader:
    """A DataLoader whose batches arrive on ``device``; other attributes pass through
    (``len``, ``.sampler``, ``.dataset``, ``.batch_size`` …)."""

    def __init__(self, loader: DataLoader, device: torch.device, auto_transfer: bool = True) -> None:
        self._loader = loader
        self._device = device
        self._prefetch = auto_transfer and device.type == "cuda"
        self._held = 0  # batches taken from the loader but not yet handed out (copy-ahead)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def state_dict(self) -> dict[str, Any]:
        """The loader's epoch and position (see ResumableDataLoader), not counting a batch that
        is being copied ahead."""
        if not isinstance(self._loader, ResumableDataLoader):
            raise AttributeError("state_dict: this loader has no DistributedSampler, so no resumable position.")
        return self._loader.state_dict(held_back=self._held)

    def __iter__(self) -> Iterator[Any]:
        if self._prefetch:
            self._held = 0
            batches = self._iter_prefetching()
        else:
            batches = (move_to_device(batch, self._device) for batch in self._loader)
        # a ResumableDataLoader times its own batches; time the others here (with the copy)
        return batches if isinstance(self._loader, ResumableDataLoader) else timed_batches(batches)

    def _iter_prefetching(self) -> Iterator[Any]:
        """Copy batch n+1 on a side stream while the caller works on batch n."""
        side_stream = torch.cuda.Stream(self._device)
        main_stream = torch.cuda.current_stream(self._device)

        def start_copy(batch: Any) -> tuple[Any, torch.cuda.Event]:
            with torch.cuda.stream(side_stream):
                moved = move_to_device(batch, self._device, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side_stream)
            return moved, copied

        pending = None
        for batch in self._loader:
            ready, pending = pending, start_copy(batch)
            self._held = 1
            if ready is not None:
                yield _handed_to(*ready, main_stream)
        self._held = 0
        if pending is not None:
            yield _handed_to(*pending, main_stream)


def _handed_to(batch: Any, copied: torch.cuda.Event, main_stream: torch.cuda.Stream) -> Any:
    """Make ``main_stream`` wait for the copy of ``batch`` (only that copy, not the next one),
    and tell the allocator its tensors are used there."""
    main_stream.wait_event(copied)

    def used_on_main_stream(tensor: torch.Tensor) -> torch.Tensor:
        tensor.record_stream(main_stream)
        return tensor

    return _map_tensors(batch, used_on_main_stream)


# -- reproducibility -----------------------------------------------------------------------------


_reproducible_seed: int | None = None


class _SeededWorkerInit:
    """A data-loader ``worker_init_fn`` that seeds numpy and random from torch's per-worker
    seed, then calls the user's own function."""

    def __init__(self, user_init: Callable[[int], None] | None) -> None:
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        seed = torch.initial_seed() % 2**32
        random.seed(seed)
        try:
            import numpy

            numpy.random.seed(seed)
        except ImportError:
            pass
        if self.user_init is not None:
            self.user_init(worker_id)


def enable_reproducibility(seed: int = 0) -> None:
    """Seed torch, random and numpy, make torch choose deterministic algorithms, and make
    later :func:`prepare_data_loader` calls seed their shuffling and loader worker processes.

    Deterministic algorithms can be slower; some operations raise when they have none.
    """
    global _reproducible_seed
    _reproducible_seed = seed
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


_AMP_INSTEAD = (
    "use PyTorch's mixed precision directly: `with torch.autocast(device_type=lockstep.torch.get_device().type):` "
    "around the forward pass and a `torch.amp.GradScaler()` for the loss "
    "(`scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()`), or Lightning / Accelerate."
)
accelerate = removed_function("lockstep.torch.accelerate", _AMP_INSTEAD)
backward = removed_function("lockstep.torch.backward", "call loss.backward(), or with AMP " + _AMP_INSTEAD)
prepare_optimizer = removed_function(
    "lockstep.torch.prepare_optimizer", "use the optimizer as it is; for AMP " + _AMP_INSTEAD
)
