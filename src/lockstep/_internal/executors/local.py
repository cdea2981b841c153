"""The local executor: each rank is a fresh Python process on this machine, and this process
drives the run.

Processes are started with ``subprocess``, or forked by a warm process that imported torch
before ``fit()`` (never a fork of the driver; see :mod:`lockstep._internal.warm.warm_start`), each in its own
process group so that stopping a rank also stops its data-loader processes. The driver waits
on the workers' sockets and process handles at once, so it wakes only when something happens.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import AbstractContextManager, suppress
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lockstep._internal.executors.base import Executor
from lockstep._internal.executors.channels import ChannelGroup
from lockstep._internal.executors.local_resources import check_local_resources, cpus_in_use, local_capacity
from lockstep._internal.payload import TrainJob, payload_in_memory, serialize_payload
from lockstep._internal.rank.devices import usable_gpu_ids
from lockstep._internal.rank.python_path import worker_pythonpath
from lockstep._internal.rank.rank_env import RankEnv, threads_for
from lockstep._internal.rank.stack_buffer import ENV_STACK_FD, new_stack_buffer, read_dump
from lockstep._internal.rank.whereabouts import dump_without_plumbing
from lockstep._internal.rank.worker import ENV_PAYLOAD_FD
from lockstep._internal.run.worker_group import GroupFactory, GroupSpec, WorkerExited
from lockstep._internal.warm import warm_start
from lockstep._internal.warm.warm_handle import RankFiles, RankProcess, exit_handle

if TYPE_CHECKING:
    from lockstep._internal.run.driver import RunDriver
    from lockstep._internal.run.validation import ValidationLauncher
    from lockstep.config import ScalingConfig
    from lockstep.result import Result
    from lockstep.validation import ValidationConfig

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
STACK_DUMP_WAIT_S = 2.0
STACK_DUMP_POLL_S = 0.05


def host_rendezvous_store(host: str) -> Any:
    """A torch.distributed TCPStore served by the driver on a free port of ``host``.

    Workers find it at MASTER_ADDR/MASTER_PORT and, told by TORCHELASTIC_USE_AGENT_STORE (as
    torchrun tells its workers), all join it as clients. Because it exists before any worker
    starts, no rank waits for rank 0 to open a store and retries (which costs about a second).
    """
    from torch.distributed import TCPStore

    return TCPStore(host, 0, is_master=True, wait_for_workers=False)


def gpu_slots(rank: int, gpus_per_worker: float) -> list[int]:
    """Indices (into the visible GPU list) given to ``rank``: whole GPUs each, or a shared one
    when ``gpus_per_worker`` is a fraction."""
    if gpus_per_worker <= 0:
        return []
    if gpus_per_worker < 1:
        return [math.floor(rank * gpus_per_worker)]
    per_worker = int(gpus_per_worker)
    return list(range(rank * per_worker, (rank + 1) * per_worker))


def start_rank_process(env: dict[str, str], files: RankFiles, piped: bool) -> subprocess.Popen[bytes]:
    """Start a rank as a fresh interpreter in a session of its own (the plain way; see
    :mod:`lockstep._internal.warm.warm_start` for the warm one), its output piped when ``piped``."""
    stream = subprocess.PIPE if piped else None
    return subprocess.Popen(
        [sys.executable, "-m", "lockstep._internal.rank.worker"],
        env=env,
        start_new_session=True,
        pass_fds=list(files),
        stdout=stream,
        stderr=stream,
    )


class LocalExecutor(Executor):
    """Worker processes on this machine, started afresh for each attempt.

    Raises:
        ValueError: this machine can't meet the request (raised when it is made).
    """

    name = "local"

    def __init__(self, scaling: ScalingConfig, spec: GroupSpec) -> None:
        check_local_resources(spec if scaling.elastic else replace(spec, num_workers=scaling.max_workers))
        self.spec = spec
        self.min_workers, self.max_workers = scaling.min_workers, scaling.max_workers

    def reserve(self, run_name: str) -> AbstractContextManager[None]:
        """The workers' CPUs, counted with those of other local fits running at once."""
        return cpus_in_use(self.max_workers * self.spec.cpus_per_worker)

    def validation_launcher(self, config: ValidationConfig, log_dir: str) -> ValidationLauncher:
        """A fresh process per validation, its CPUs counted with the workers' and its GPUs, when
        it asks for some, others than the workers' if there are enough."""
        from lockstep._internal.executors.local_validation import ProcessValidationLauncher

        spec = self.spec
        workers_gpus: tuple[str, ...] = ()
        if spec.use_gpu and spec.gpus_per_worker > 0:
            workers_gpus = tuple(usable_gpu_ids()[: math.ceil(self.max_workers * spec.gpus_per_worker)])
        return ProcessValidationLauncher(
            config, log_dir, workers_cpus=self.max_workers * spec.cpus_per_worker, workers_gpus=workers_gpus
        )

    def launch(self, job: TrainJob, driver: RunDriver) -> Result:
        """Serialize the job once, then let the driver run attempts of fresh processes."""
        payload = serialize_payload(job)
        spec = replace(self.spec, log_dir=driver.log_dir, console=driver.console)
        return driver.run(
            GroupFactory(
                executor=self.name,
                start_group=lambda size: LocalWorkerGroup(replace(spec, num_workers=size), payload),
                min_workers=self.min_workers,
                max_workers=self.max_workers,
                capacity=lambda: local_capacity(spec),
            )
        )


class LocalWorkerGroup(ChannelGroup):
    """``num_workers`` processes on this machine, each running the serialized job ``payload``."""

    def __init__(self, spec: GroupSpec, payload: bytes) -> None:
        super().__init__(LOOPBACK, spec.num_workers, spec.log_dir, spec.console)
        self.spec = spec
        self.payload = payload
        self._processes: dict[int, RankProcess] = {}
        self._exit_handles: dict[int, int] = {}
        self._payload_fd: int | None = None
        self._store: Any = None
        self._stack_fds: dict[int, int] = {}

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Put the payload in memory the workers inherit, then start every rank."""
        self._payload_fd = payload_in_memory(self.payload)
        self._store = host_rendezvous_store(LOOPBACK)
        master_port = self._store.port
        gpu_ids = usable_gpu_ids() if self.spec.use_gpu else []
        start_rank = warm_start.rank_starter(self.payload, start_rank_process)
        for rank in range(self.spec.num_workers):
            self._stack_fds[rank] = new_stack_buffer()
            env = self._worker_env(rank, master_port, gpu_ids)
            files = RankFiles(payload=self._payload_fd, stacks=self._stack_fds[rank])
            process = start_rank(env, files, self._output is not None)
            if self._output is not None:
                self._output.attach(rank, process.stdout, process.stderr)
            self._processes[rank] = process
            self._exit_handles[rank] = exit_handle(process)
            self._channels.watch(self._exit_handles[rank], tag=rank)
        logger.debug("started %d worker processes", self.spec.num_workers)

    def _worker_env(self, rank: int, master_port: int, gpu_ids: list[str]) -> dict[str, str]:
        num_workers = self.spec.num_workers
        own_gpus = (
            tuple(gpu_ids[slot] for slot in gpu_slots(rank, self.spec.gpus_per_worker)) if self.spec.use_gpu else ()
        )
        rank_env = RankEnv(
            world_rank=rank,
            world_size=num_workers,
            local_rank=rank,
            local_world_size=num_workers,
            node_rank=0,
            master_addr=LOOPBACK,
            master_port=master_port,
            threads=threads_for(self.spec.cpus_per_worker),
            visible_gpus=own_gpus if self.spec.use_gpu else None,
            gpu_ids=own_gpus,
        )
        env = dict(os.environ)
        env.update(
            rank_env.variables(),
            PYTHONPATH=worker_pythonpath(env),
            **{ENV_PAYLOAD_FD: str(self._payload_fd), ENV_STACK_FD: str(self._stack_fds[rank])},
            **self._channels.worker_env(rank),
        )
        return env

    # -- events --------------------------------------------------------------------------------

    def wait_events(self, timeout: float | None) -> list[Any]:
        """Wait on the workers' channels and their exit handles together."""
        events, exited_ranks = self._wait(timeout)
        for rank in exited_ranks:
            events += self._on_exit(rank)
        return events

    def _on_exit(self, rank: int) -> list[Any]:
        """A rank's process ended: first deliver what it sent before dying, then the exit."""
        handle = self._exit_handles.pop(rank)
        self._channels.unwatch(handle)
        os.close(handle)
        self._processes[rank].wait()
        return [*self._channels.drain_rank(rank), WorkerExited(rank, self._processes[rank].returncode)]

    # -- diagnostics ---------------------------------------------------------------------------

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each rank (SIGUSR1 → faulthandler) where it is. A dump counts once its file has
        stopped growing (faulthandler writes it line by line); wait up to 2 s in all."""
        asked = [rank for rank in ranks if self._processes[rank].poll() is None]
        for rank in asked:
            os.kill(self._processes[rank].pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        seen: dict[int, str] = {}
        complete: dict[int, str] = {}
        while len(complete) < len(asked) and time.monotonic() < deadline:
            time.sleep(STACK_DUMP_POLL_S)
            for rank in asked:
                text = read_dump(self._stack_fds[rank])
                if text and text == seen.get(rank):
                    complete[rank] = text
                seen[rank] = text
        return {rank: dump_without_plumbing(text) for rank, text in {**seen, **complete}.items() if text}

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGKILL every rank's process group and reap the processes."""
        for process in self._processes.values():
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for rank, process in self._processes.items():
            _reap(rank, process)
        for handle in self._exit_handles.values():
            os.close(handle)
        self._exit_handles.clear()
        self._close_channels()
        if self._payload_fd is not None:
            os.close(self._payload_fd)
            self._payload_fd = None
        for stack_fd in self._stack_fds.values():
            os.close(stack_fd)
        self._stack_fds.clear()
        self._store = None


def _reap(rank: int, process: RankProcess) -> None:
    """Wait for a killed rank's process, at most :data:`REAP_WAIT_S`: one in uninterruptible I/O
    (a hard-mounted NFS that went away) can't die, and the run must not wait on it forever."""
    try:
        process.wait(timeout=REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        logger.error(
            "rank %d (pid %d) is still there %g s after SIGKILL: it is stuck in the kernel (uninterruptible "
            "I/O, e.g. on a storage that stopped answering); lockstep goes on without it.",
            rank,
            process.pid,
            REAP_WAIT_S,
        )


#: How long :meth:`LocalWorkerGroup.stop` waits for each killed rank's process.
REAP_WAIT_S = 30.0
