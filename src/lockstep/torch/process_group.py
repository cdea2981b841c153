"""Joining the torch.distributed process group within a bounded time.

A rank that can't reach the others at the start (a wrong address advertised, a firewall, a rank
that never comes) would otherwise wait as long as a collective may: 30 minutes by default. The
group is joined with ``start_timeout_s`` instead, and the collectives' own timeout is set once
every rank is in (``torch.distributed.set_timeout``, new in torch 2.14: the reason lockstep
needs torch >= 2.14). A rank that fails to join says what it advertised and how to fix it.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket

import torch.distributed as dist

from lockstep._internal.rank.rank_env import ENV_STORE_PREFIX

__all__ = ["ProcessGroupStartError", "join_process_group"]


logger = logging.getLogger(__name__)

#: Variables that choose the interface (and so the address) gloo and nccl advertise.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class ProcessGroupStartError(RuntimeError):
    """This rank could not join the process group: not within the start timeout, or not at all (a
    backend this machine or this build of torch lacks)."""


def join_process_group(
    backend: str, init_method: str, rank: int, world_size: int, start_timeout_s: float, timeout_s: float
) -> None:
    """Join the default process group, waiting at most ``start_timeout_s`` for the other ranks;
    then let collectives wait up to ``timeout_s``.

    Raises:
        ProcessGroupStartError: the group could not be joined in time (says what this rank
            advertised and how to fix it).
    """
    start_timeout = datetime.timedelta(seconds=min(start_timeout_s, timeout_s))
    try:
        _init(backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=start_timeout)
    except Exception as error:  # noqa: BLE001 - torch raises several types here; all mean the same
        raise ProcessGroupStartError(describe_start_failure(rank, world_size, start_timeout_s, error)) from error
    dist.set_timeout(datetime.timedelta(seconds=timeout_s))
    logger.debug("rank %d joined the %s process group", rank, backend)


def _init(backend: str, init_method: str, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    store = _prefixed_store(timeout) if init_method == "env" else None
    if store is not None:
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        return
    url = "env://" if init_method == "env" else f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group(backend=backend, init_method=url, rank=rank, world_size=world_size, timeout=timeout)


def _prefixed_store(timeout: datetime.timedelta) -> dist.Store | None:
    """With LOCKSTEP_STORE_PREFIX set (under torchrun, whose store outlives a restart of the
    group), the rendezvous store at MASTER_ADDR:MASTER_PORT seen under that prefix, so that a
    restarted group never reads the addresses its predecessor left there."""
    prefix = os.environ.get(ENV_STORE_PREFIX)
    if not prefix:
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(prefix, client)


def describe_start_failure(rank: int, world_size: int, start_timeout_s: float, error: BaseException) -> str:
    """What went wrong when ``rank`` tried to join, what it advertised, and what to do."""
    if not _network_failure(error):
        return (
            f"rank {rank} of {world_size} could not start its process group: {type(error).__name__}: "
            f"{_first_line(error)}\nThis is not a network problem: check TorchConfig(backend=...) (gloo runs on "
            "CPUs, nccl needs a GPU per worker: ScalingConfig(use_gpu=True)) and that this build of torch has it."
        )
    master = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (
        f"rank {rank} of {world_size} could not join the process group within {start_timeout_s:g} s "
        f"(rendezvous at {master}; this rank advertised {advertised_address()}): {type(error).__name__}: "
        f"{_first_line(error)}\nThe ranks must reach each other at the addresses they advertise. Set "
        "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME with GPUs) to the network interface that reaches the other "
        "hosts (see `ip addr`), check that no firewall blocks the ports between them, or give slow-starting "
        "ranks more time with TorchConfig(start_timeout_s=...)."
    )


#: Words of torch's errors for a backend it can't start at all (no network involved).
_NOT_NETWORK = re.compile(r"built in|not supported|only supported|no gpus found|invalid backend|unknown backend", re.I)


def _network_failure(error: BaseException) -> bool:
    """Whether ``error`` may come from ranks not reaching each other (timeouts, refused or reset
    connections), rather than from a backend that can't start on this machine at all."""
    if isinstance(error, (ValueError, TypeError, NotImplementedError)):
        return False
    return not _NOT_NETWORK.search(str(error))


def advertised_address() -> str:
    """The address gloo advertises for this rank, and why: the interface named in
    GLOO_SOCKET_IFNAME, else what the hostname resolves to."""
    for name in INTERFACE_VARIABLES[:1]:
        if os.environ.get(name):
            return f"the address of interface {os.environ[name]!r} ({name})"
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        return f"its hostname {hostname!r}, which does not resolve"
    loopback = " — a loopback address, which other hosts can't reach" if address.startswith("127.") else ""
    return f"{address}, what its hostname {hostname!r} resolves to{loopback}"


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"
