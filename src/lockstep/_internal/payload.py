"""The job every rank runs (:class:`TrainJob`), and how the driver ships it to its workers.

Under torchrun each process builds its own job and nothing is shipped. The local and Ray
executors serialize it once per ``fit()`` with cloudpickle (functions defined in ``__main__`` travel by value, so
the user's script is never re-imported in a worker) before any worker starts, so that an
object that can't be pickled is reported to the user at once.

Large CPU tensors reachable from it (a dataset captured by the train function, say) are not
pickled: their bytes are laid out after the pickle, and a worker that maps the payload file
(the local executor's) uses them where they lie, so N workers share one copy of the memory
(copy-on-write: a rank that writes to such a tensor gets a private copy of the pages it writes).

Layout: ``MAGIC``, the pickle's length, the number of tensors, one (offset, length) per tensor,
the pickle, then each tensor's bytes at a 64-byte-aligned offset.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from lockstep._internal.persist.storage import RunStorage
from lockstep.backend import BackendConfig
from lockstep.checkpoint import Checkpoint
from lockstep.config import DataConfig

logger = logging.getLogger(__name__)

LARGE_PAYLOAD_BYTES = 100 * 1024 * 1024
SHARED_TENSOR_MIN_BYTES = 1024 * 1024
MAGIC = b"LSPAYLD1"
ALIGNMENT = 64


@dataclass
class TrainJob:
    """What every rank runs: the same for all ranks and for every attempt of a run. (Where an
    attempt starts, the driver says in its ``Start`` message.)

    Attributes:
        resume_checkpoint: The trainer's ``resume_from_checkpoint``: where the run starts when
            it has no checkpoint of its own yet.
        main_file: The user's script, so that tracebacks show its path.
        has_validation: The trainer has a ``validation_config`` (``report(validation=...)`` is allowed).
        every_rank_metrics: Every rank sends its metrics with each report, not only rank 0
            (a ``UserCallback`` gets them all).
    """

    train_fn: Callable[..., Any]
    train_loop_config: dict[str, Any] | None
    backend_config: BackendConfig
    use_gpu: bool
    storage: RunStorage
    resume_checkpoint: Checkpoint | None = None
    datasets: dict[str, Any] = field(default_factory=dict)
    dataset_config: DataConfig = field(default_factory=DataConfig)
    metadata: dict[str, Any] = field(default_factory=dict)
    main_file: str | None = field(default_factory=lambda: main_file())
    has_validation: bool = False
    every_rank_metrics: bool = False


def payload_in_memory(payload: bytes) -> int:
    """An anonymous in-memory file holding ``payload`` (its offset at the end). The kernel frees
    it when the last process holding it ends, so nothing is left behind even if the driver is
    killed."""
    handle = os.memfd_create("lockstep_payload", os.MFD_CLOEXEC)
    view = memoryview(payload)
    while view:
        view = view[os.write(handle, view) :]
    return handle


def main_file() -> str | None:
    """The path of the user's script, when the driver runs one."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path else None


def serialize_payload(payload: TrainJob) -> bytes:
    """The payload in the layout above, naming the offending object if something can't be pickled.

    Raises:
        TypeError: an object reachable from the train function, its config or the datasets
            can't be pickled (the message names it).
    """
    tensors: list[Any] = []
    stream = io.BytesIO()
    try:
        _PayloadPickler(stream, tensors).dump(payload)
    except Exception as error:
        culprit = _find_unpicklable(payload)
        raise TypeError(
            f"{culprit} can't be sent to the workers: {type(error).__name__}: {error}. Create such "
            "objects (locks, open files, connections, CUDA state) inside the train function instead."
        ) from error
    pickled = stream.getvalue()
    if len(pickled) > LARGE_PAYLOAD_BYTES:
        logger.warning(
            "The train function and its config pickle to %.0f MB, copied to every worker. Load large "
            "datasets and models inside the train function instead of capturing or passing them "
            "(plain CPU tensors are shared, not copied).",
            len(pickled) / 1e6,
        )
    return _laid_out(pickled, tensors)


class _PayloadPickler(cloudpickle.Pickler):
    """cloudpickle, except that large plain CPU tensors are set aside in ``tensors``."""

    def __init__(self, stream: io.BytesIO, tensors: list[Any]) -> None:
        super().__init__(stream, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and _shareable(obj):
            self.tensors.append(obj.detach().contiguous())
            return _shared_tensor, (len(self.tensors) - 1, obj.dtype, tuple(obj.shape), obj.requires_grad)
        return super().reducer_override(obj)


def _shareable(tensor: Any) -> bool:
    import torch

    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()  # a lazy conjugate or negative view has no plain bytes to share
        and not tensor.is_neg()
        and tensor.dim() > 0
        and tensor.numel() * tensor.element_size() >= SHARED_TENSOR_MIN_BYTES
    )


def _laid_out(pickled: bytes, tensors: list[Any]) -> bytes:
    """Header, pickle, then each tensor's bytes at an aligned offset."""
    import torch

    blobs = [memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) for tensor in tensors]
    offset = len(MAGIC) + 16 + 16 * len(blobs) + len(pickled)
    entries: list[int] = []
    parts: list[Any] = []
    for blob in blobs:
        start = -(-offset // ALIGNMENT) * ALIGNMENT
        parts += [bytes(start - offset), blob]
        entries += [start, blob.nbytes]
        offset = start + blob.nbytes
    head = MAGIC + struct.pack(f"<QQ{len(entries)}Q", len(pickled), len(blobs), *entries)
    return b"".join([head, pickled, *parts])


_loading: tuple[Any, tuple[int, ...]] | None = None


def deserialize_payload(buffer: Any) -> TrainJob:
    """The payload from ``buffer`` (bytes, or a writable copy-on-write map of the payload file,
    whose tensors are then used in place)."""
    global _loading
    view = memoryview(buffer)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a lockstep payload (wrong lockstep version in a worker?)")
    pickle_length, count = struct.unpack_from("<QQ", view, len(MAGIC))
    table = struct.unpack_from(f"<{2 * count}Q", view, len(MAGIC) + 16)
    start = len(MAGIC) + 16 + 16 * count
    _loading = (buffer, table)
    try:
        return cloudpickle.loads(view[start : start + pickle_length])
    finally:
        _loading = None


def _shared_tensor(index: int, dtype: Any, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """Rebuild tensor ``index`` of the payload being loaded, in place when the buffer allows it."""
    import torch

    assert _loading is not None, "a shared tensor outside deserialize_payload"
    buffer, table = _loading
    offset, length = table[2 * index], table[2 * index + 1]
    if memoryview(buffer).readonly:
        flat = torch.frombuffer(bytearray(memoryview(buffer)[offset : offset + length]), dtype=torch.uint8)
    else:
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=length, offset=offset)
    return flat.view(dtype).reshape(shape).requires_grad_(requires_grad)


def _find_unpicklable(payload: TrainJob) -> str:
    """A human name for the first part of the payload that fails to pickle."""
    candidates: list[tuple[str, Any]] = []
    candidates += [(f"train_loop_config[{key!r}]", value) for key, value in (payload.train_loop_config or {}).items()]
    candidates += [(f"datasets[{key!r}]", value) for key, value in payload.datasets.items()]
    candidates += _captured_by(payload.train_fn)
    candidates.append(("the train function", payload.train_fn))
    for name, value in candidates:
        try:
            cloudpickle.dumps(value)
        except Exception:
            return name
    return "part of the trainer's arguments"


def _captured_by(function: Any) -> list[tuple[str, Any]]:
    """The globals and closure variables a function refers to, with readable names."""
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    found: list[tuple[str, Any]] = []
    fn_globals = getattr(function, "__globals__", {})
    found += [
        (f"the global {name!r} used by the train function", fn_globals[name])
        for name in code.co_names
        if name in fn_globals
    ]
    for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
        try:
            found.append((f"the variable {name!r} captured by the train function", cell.cell_contents))
        except ValueError:
            continue
    return found
