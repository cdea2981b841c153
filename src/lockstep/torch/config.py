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
INIT_METHODS = ("env", "tcp")


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
        init_method: ``"env"`` (MASTER_ADDR/MASTER_PORT variables) or ``"tcp"`` (a tcp:// URL).
        timeout_s: Seconds a collective may wait before it fails.
    """

    backend: str | None = None
    init_method: Literal["env", "tcp"] = "env"
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"TorchConfig.backend={self.backend!r} is unknown; use None or one of {BACKENDS}.")
        if self.init_method not in INIT_METHODS:
            raise ValueError(f"TorchConfig.init_method={self.init_method!r} must be 'env' or 'tcp'.")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"TorchConfig.timeout_s must be a number of seconds > 0, got {self.timeout_s!r}.")

    def resolved_backend(self, use_gpu: bool) -> str:
        """The backend to use: the one given, else nccl with GPUs and gloo without."""
        return self.backend or ("nccl" if use_gpu else "gloo")

    def on_worker_start(self, context: TrainContext, use_gpu: bool) -> None:
        """Join the process group (MASTER_ADDR/MASTER_PORT come from the environment)."""
        backend = self.resolved_backend(use_gpu)
        if backend == "nccl":
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
