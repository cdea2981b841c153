"""TorchConfig: how the torch.distributed process group is set up in each worker."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from lockstep._internal.rank_env import ENV_STORE_PREFIX
from lockstep.backend import BackendConfig
from lockstep.context import TrainContext

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


def _prefixed_store(timeout: datetime.timedelta) -> dist.Store | None:
    """With LOCKSTEP_STORE_PREFIX set (under torchrun, whose store outlives a restart of the
    group), the rendezvous store at MASTER_ADDR:MASTER_PORT seen under that prefix, so that a
    restarted group never reads the addresses its predecessor left there."""
    prefix = os.environ.get(ENV_STORE_PREFIX)
    if not prefix:
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(prefix, client)


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
    """

    backend: str | None = None
    init_method: Literal["env", "tcp"] = "env"
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.backend is not None:
            if not isinstance(self.backend, str):
                raise ValueError(f"TorchConfig.backend must be a string such as 'gloo', got {self.backend!r}.")
            parse_backend(self.backend)
        if self.init_method not in INIT_METHODS:
            raise ValueError(f"TorchConfig.init_method={self.init_method!r} must be 'env' or 'tcp'.")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"TorchConfig.timeout_s must be a number of seconds > 0, got {self.timeout_s!r}.")

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
            from lockstep.torch.train_loop_utils import get_device

            torch.cuda.set_device(get_device())
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = _prefixed_store(timeout) if self.init_method == "env" else None
        if store is not None:
            dist.init_process_group(backend=backend, store=store, rank=context.world_rank,
                                    world_size=context.world_size, timeout=timeout)
        else:
            init_method = "env://" if self.init_method == "env" else (
                f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
            dist.init_process_group(backend=backend, init_method=init_method, rank=context.world_rank,
                                    world_size=context.world_size, timeout=timeout)
        logger.debug("rank %d joined the %s process group", context.world_rank, backend)

    def on_worker_shutdown(self) -> None:
        """Leave the process group and release cached GPU memory."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
