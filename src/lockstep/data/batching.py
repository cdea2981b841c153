"""The steps of turning a map-style dataset into batches the way Ray Data's ``iter_batches`` /
``iter_torch_batches`` do: row order (with a local shuffle buffer), batches of row indices,
collation, dtypes, and fetching batches ahead on a background thread."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.utils.data import default_collate

__all__ = [
    "BATCH_FORMATS",
    "Batches",
    "cast_dtypes",
    "check_batch_format",
    "check_batching",
    "format_batch",
    "index_batches",
    "items_of",
    "map_tensors",
    "pin",
    "prefetched",
    "row_order",
    "to_numpy",
]


T = TypeVar("T")

#: Batch formats of ``iter_batches`` for torch datasets: how :func:`format_batch` shapes a batch.
BATCH_FORMATS = ("default", "numpy", None)


def row_order(length: int, shuffle_buffer_size: int | None, batch_size: int | None, seed: int | None) -> Iterator[int]:
    """Row indices ``0 … length-1`` in the order they are read.

    With a ``shuffle_buffer_size`` rows go through a buffer of that many rows (at least
    ``batch_size``, as in Ray Data) and leave it in random order, seeded by ``seed``: the same
    seed gives the same order on every call, no seed a new order each time.

    Check the arguments first with :func:`check_batching`.
    """
    if shuffle_buffer_size is None:
        yield from range(length)
        return
    rng = random.Random(seed)
    capacity = max(shuffle_buffer_size, batch_size or 1)
    buffer: list[int] = []
    for index in range(length):
        buffer.append(index)
        if len(buffer) >= capacity:
            yield _take_random(buffer, rng)
    rng.shuffle(buffer)
    yield from buffer


def _take_random(buffer: list[int], rng: random.Random) -> int:
    pick = rng.randrange(len(buffer))
    buffer[pick], buffer[-1] = buffer[-1], buffer[pick]
    return buffer.pop()


def index_batches(rows: Iterable[int], batch_size: int | None, drop_last: bool) -> Iterator[list[int]]:
    """Group row indices into batches of ``batch_size`` (None: one batch of every row); the
    last, smaller batch is dropped with ``drop_last``."""
    batch: list[int] = []
    for index in rows:
        batch.append(index)
        if batch_size is not None and len(batch) == batch_size:
            yield batch
            batch = []
    if batch and not (drop_last and batch_size is not None):
        yield batch


def check_batching(batch_size: int | None, shuffle_buffer_size: int | None) -> None:
    """Raises a ValueError for a batch size or shuffle buffer that can't be used."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive number of rows or None (the whole shard), got {batch_size!r}.")
    if shuffle_buffer_size is None:
        return
    if batch_size is None:
        raise ValueError("local_shuffle_buffer_size needs a batch_size: pass batch_size=<rows per batch>.")
    if isinstance(shuffle_buffer_size, bool) or not isinstance(shuffle_buffer_size, int) or shuffle_buffer_size < 1:
        raise ValueError(f"local_shuffle_buffer_size must be a positive number of rows, got {shuffle_buffer_size!r}.")


def check_batch_format(batch_format: str | None) -> None:
    """Raises a ValueError for a batch format torch datasets can't give."""
    if batch_format not in BATCH_FORMATS:
        raise ValueError(
            f"batch_format={batch_format!r}: a torch dataset's shard gives 'default' batches (collated as a "
            "DataLoader does, into tensors), 'numpy' ones (numpy arrays) or None (the list of items); pass "
            "a ray.data.Dataset to get 'pandas' or 'pyarrow' batches."
        )


def format_batch(items: list[Any], batch_format: str | None) -> Any:
    """``items`` as one batch in ``batch_format`` (see :data:`BATCH_FORMATS`)."""
    if batch_format is None:
        return items
    batch = default_collate(items)
    return to_numpy(batch) if batch_format == "numpy" else batch


def to_numpy(batch: Any) -> Any:
    """Every tensor in ``batch`` (nested in dicts, lists, tuples) as a numpy array."""
    return map_tensors(batch, lambda tensor: tensor.numpy())


def map_tensors(batch: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``function`` applied to each tensor in it, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, Mapping):
        return type(batch)({key: map_tensors(value, function) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(value, function) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(value, function) for value in batch)
    return batch


def cast_dtypes(batch: Any, dtypes: torch.dtype | Mapping[str, torch.dtype] | None) -> Any:
    """``batch`` with its tensors cast as Ray Data's ``dtypes=`` says: one dtype for every
    tensor, or a dtype per key of a dict batch.

    Raises:
        ValueError: ``dtypes`` is a dict but the batch is not, or names a key it lacks.
    """
    if dtypes is None:
        return batch
    if isinstance(dtypes, torch.dtype):
        return map_tensors(batch, lambda tensor: tensor.to(dtypes))
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"dtypes={dtypes!r} names columns, but this dataset's batches are {type(batch).__name__}s, not "
            "dicts: pass one torch dtype for every tensor, or make the dataset's items dicts."
        )
    missing = sorted(set(dtypes) - set(batch))
    if missing:
        raise ValueError(f"dtypes names {missing}, which the batches lack; their keys are {sorted(batch)}.")
    cast = {key: map_tensors(value, _to_dtype(dtypes[key])) if key in dtypes else value for key, value in batch.items()}
    return type(batch)(cast)  # type: ignore[call-arg]


def pin(batch: Any) -> Any:
    """``batch`` with its CPU tensors in pinned memory (for faster copies to the GPU); as is
    where there is no GPU, since pinned memory is a GPU driver's."""
    if not torch.cuda.is_available():
        return batch
    return map_tensors(batch, lambda tensor: tensor.pin_memory() if tensor.device.type == "cpu" else tensor)


# -- fetching ahead -----------------------------------------------------------------------------

_END = object()


def prefetched(batches: Iterator[T], count: int) -> Iterator[T]:
    """Yield what ``batches`` yields, with up to ``count`` batches made ahead on a background
    thread (0: made when asked for). Stopping early (``break``) stops the thread too; an error
    while making a batch is raised where that batch would have been yielded."""
    if count <= 0:
        yield from batches
        return
    ready: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(maxsize=count)
    stop = threading.Event()
    thread = threading.Thread(target=_produce, args=(batches, ready, stop), daemon=True, name="lockstep-prefetch")
    thread.start()
    try:
        while (item := ready.get())[0] is not _END:
            yield item[0]
        if item[1] is not None:
            raise item[1]
    finally:
        stop.set()
        thread.join()


def _produce(
    batches: Iterator[Any], ready: queue.Queue[tuple[Any, BaseException | None]], stop: threading.Event
) -> None:
    try:
        for batch in batches:
            if not _put(ready, (batch, None), stop):
                return
        _put(ready, (_END, None), stop)
    except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
        _put(ready, (_END, error), stop)


def _put(ready: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put ``item`` once there is room; False if the consumer stopped first."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def items_of(dataset: Any, indices: list[int]) -> list[Any]:
    """The items of ``dataset`` at ``indices``."""
    return [dataset[index] for index in indices]


class Batches:
    """An iterable of batches that can be read more than once: each pass calls ``make`` for a
    fresh iterator (so a shuffle without a seed gives a new order each pass)."""

    def __init__(self, make: Callable[[], Iterator[Any]]) -> None:
        self._make = make

    def __iter__(self) -> Iterator[Any]:
        return self._make()


def _to_dtype(dtype: Any) -> Callable[[Any], Any]:
    """A function that casts a tensor to ``dtype``."""
    return lambda tensor: tensor.to(dtype)
