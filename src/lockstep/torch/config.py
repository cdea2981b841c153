"""TorchConfig: how the torch.distributed process group is set up in each worker."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from lockstep.backend import BackendConfig
from lockstep.context import TrainContext
from lockstep.torch.process_group import join_process_group

__all__ = ["TorchConfig"]


logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl", "mpi", "xccl", "ucc")
DEVICE_TYPES = ("cpu", "cuda", "xpu")
INIT_METHODS = ("env", "tcp")


def parse_backend(backend: str) -> dict[str, str]:
    """A per-device backend string such as ``"cpu:gloo,cuda:nccl"`` as ``{device: backend}``
    (torch.distributed's format); ``{}`` for a plain backend name such as ``"gloo"``.

    Raises:
        ValueError: the string is neither a known backend nor ``device:backend`` pairs of known ones.
    """
    if backend in BACKENDS:
        return {}
    pairs = [item.strip().split(":") for item in backend.split(",")]
    if not all(len(pair) == 2 and pair[0] in DEVICE_TYPES and pair[1] in BACKENDS for pair in pairs):
        raise ValueError(
            f"TorchConfig.backend={backend!r} is unknown; use None, one of {BACKENDS}, or per-device pairs "
            f"such as 'cpu:gloo,cuda:nccl' (devices: {DEVICE_TYPES})."
        )
    return {device: name for device, name in pairs}


@dataclass
class TorchConfig(BackendConfig):
    """Settings of the torch.distributed process group.

    Args:
        backend: ``"nccl"``, ``"gloo"``, …; None picks nccl when workers use GPUs, else gloo.
            Per-device pairs such as ``"cpu:gloo,cuda:nccl"`` are given whole to torch when
            workers use GPUs (CPU tensors then go through gloo, CUDA tensors through nccl); on
            CPU workers only the ``cpu:`` backend is used.
        init_method: ``"env"`` (MASTER_ADDR/MASTER_PORT variables) or ``"tcp"`` (a tcp:// URL).
        timeout_s: Seconds a collective may wait before it fails.
        start_timeout_s: Seconds a rank waits for the others to join the process group at the
            start (a lockstep addition): a rank that can't reach the others fails after this
            long, saying what it advertised, instead of waiting ``timeout_s``.
    """

    backend: str | None = None
    init_method: Literal["env", "tcp"] = "env"
    timeout_s: int = 1800
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.backend is not None:
            if not isinstance(self.backend, str):
                raise ValueError(f"TorchConfig.backend must be a string such as 'gloo', got {self.backend!r}.")
            parse_backend(self.backend)
        if self.init_method not in INIT_METHODS:
            raise ValueError(f"TorchConfig.init_method={self.init_method!r} must be 'env' or 'tcp'.")
        for name in ("timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"TorchConfig.{name} must be a number of seconds > 0, got {value!r}.")

    def resolved_backend(self, use_gpu: bool) -> str:
        """The backend to use: the one given, else nccl with GPUs and gloo without. Per-device
        pairs are used whole with GPUs; without, the ``cpu:`` one alone.

        Raises:
            ValueError: per-device pairs without a ``cpu:`` one, on CPU workers.
        """
        if self.backend is None:
            return "nccl" if use_gpu else "gloo"
        per_device = parse_backend(self.backend)
        if not per_device or use_gpu:
            return self.backend
        if "cpu" not in per_device:
            raise ValueError(
                f"TorchConfig.backend={self.backend!r} names no backend for CPU workers (use_gpu=False); "
                "add one, e.g. 'cpu:gloo,cuda:nccl'."
            )
        return per_device["cpu"]

    def on_worker_start(self, context: TrainContext, use_gpu: bool) -> None:
        """Join the process group (MASTER_ADDR/MASTER_PORT come from the environment)."""
        backend = self.resolved_backend(use_gpu)
        if backend == "nccl" or "nccl" in parse_backend(backend).values():
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if use_gpu and torch.cuda.is_available():
            from lockstep._internal.rank.torch_devices import get_device

            torch.cuda.set_device(get_device())
        join_process_group(
            backend=backend,
            init_method=self.init_method,
            rank=context.world_rank,
            world_size=context.world_size,
            start_timeout_s=self.start_timeout_s,
            timeout_s=self.timeout_s,
        )

    def on_worker_shutdown(self) -> None:
        """Leave the process group and release cached GPU memory."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
