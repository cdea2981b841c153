"""A rank's environment, defined once: who the rank is, where the rendezvous is, which GPUs it
has. Every executor builds a :class:`RankEnv` and sets its :meth:`~RankEnv.variables`; the
worker runtime reads it back with :meth:`RankEnv.from_environ`.

The names are torchrun's (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so code written for torchrun works in a
lockstep worker, plus ``NODE_RANK`` and lockstep's own ``LOCKSTEP_*`` variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from lockstep._internal.wire import network

ENV_DRIVER_ADDRESS = "LOCKSTEP_DRIVER_ADDRESS"
ENV_GPU_IDS = "LOCKSTEP_GPU_IDS"
ENV_STORE_PREFIX = "LOCKSTEP_STORE_PREFIX"
ENV_NODE_ADDR = "LOCKSTEP_NODE_ADDR"
#: The variables a launcher such as torchrun sets in every process it starts.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in the group and what it needs to join the process group.

    Attributes:
        world_rank: The rank in the whole group.
        world_size: Number of ranks.
        local_rank: The rank among those on its node.
        local_world_size: Number of ranks on its node.
        node_rank: The node's index (the driver's node, or torchrun's first group, is 0).
        master_addr: Host of the rendezvous store.
        master_port: Port of the rendezvous store.
        threads: Torch/OpenMP threads (``OMP_NUM_THREADS``).
        visible_gpus: ``CUDA_VISIBLE_DEVICES`` for the rank's process (None: leave as it is).
        gpu_ids: The GPUs that are this rank's own (as ``CUDA_VISIBLE_DEVICES`` names them).
        store_is_hosted: The store at MASTER_ADDR:MASTER_PORT exists already, so every rank
            joins it as a client (torchrun's ``TORCHELASTIC_USE_AGENT_STORE``).
        store_prefix: A key prefix for the process group in that store (under torchrun, whose
            store outlives a restart of the group).
        node_addr: The address at which the other ranks reach this rank's node (Ray: the
            node's IP; torchrun: the local address that reaches MASTER_ADDR). None: loopback
            when MASTER_ADDR is loopback, else unknown.
    """

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    threads: int = 1
    visible_gpus: tuple[str, ...] | None = None
    gpu_ids: tuple[str, ...] = ()
    store_is_hosted: bool = True
    store_prefix: str | None = None
    node_addr: str | None = None

    def variables(self) -> dict[str, str]:
        """The environment variables that say all of this."""
        env = {
            "RANK": str(self.world_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_USE_AGENT_STORE": str(self.store_is_hosted),
            "OMP_NUM_THREADS": str(self.threads),
            "PYTHONUNBUFFERED": "1",
            ENV_GPU_IDS: ",".join(self.gpu_ids),
        }
        if self.visible_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_gpus)
        env.update(self._accelerate_variables())
        if self.store_prefix:
            env[ENV_STORE_PREFIX] = self.store_prefix
        if self.node_addr:
            env[ENV_NODE_ADDR] = self.node_addr
        return env

    def socket_variables(self, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` naming the interface that holds this
        rank's node address, so that the process group advertises an address the other ranks
        reach whatever the hostname resolves to; those ``environ`` sets already are left out
        (the user's choice wins). Interfaces are a host's own: call this in the rank's process.
        Empty for a rank alone in its group, or when the node address is unknown or no
        interface here holds it."""
        if self.world_size < 2:
            return {}
        address = self.node_addr or (network.LOOPBACK if network.is_loopback(self.master_addr) else None)
        return network.socket_variables(address, environ) if address else {}

    def _accelerate_variables(self) -> dict[str, str]:
        """What Hugging Face Accelerate (and the transformers Trainer) read to find this rank's
        device: without GPUs, Accelerate joins a CPU process group only when told to use the
        CPU; with GPUs, the rank's own GPU as torch numbers it under CUDA_VISIBLE_DEVICES."""
        if not self.gpu_ids:
            return {"ACCELERATE_USE_CPU": "true"}
        own = self.gpu_ids[0]
        if self.visible_gpus is not None and own in self.visible_gpus:
            index = self.visible_gpus.index(own)
        else:
            index = int(own) if own.isdigit() else 0
        return {"ACCELERATE_TORCH_DEVICE": f"cuda:{index}"}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> RankEnv:
        """The rank described by ``environ`` (a lockstep worker's, or a process that torchrun
        started: ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` are then read where lockstep's own
        names are missing)."""
        return cls(
            world_rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])),
            node_rank=int(environ.get("NODE_RANK", environ.get("GROUP_RANK", "0"))),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
            threads=int(environ.get("OMP_NUM_THREADS", "1")),
            gpu_ids=tuple(item for item in environ.get(ENV_GPU_IDS, "").split(",") if item),
            store_is_hosted=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            store_prefix=environ.get(ENV_STORE_PREFIX) or None,
            node_addr=environ.get(ENV_NODE_ADDR) or None,
        )


def threads_for(cpus_per_worker: float) -> int:
    """The thread count for a worker of ``cpus_per_worker`` CPUs (at least one)."""
    return max(1, int(cpus_per_worker))


def launched_by_launcher() -> bool:
    """Whether torchrun (or alike) started this process: it set every launcher variable, and
    this is not one of lockstep's own workers (which have them too)."""
    return ENV_DRIVER_ADDRESS not in os.environ and all(name in os.environ for name in LAUNCHER_VARIABLES)
