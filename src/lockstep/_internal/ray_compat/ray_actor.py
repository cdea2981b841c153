"""One rank of the Ray executor: a Ray actor whose process runs the train function.

The actor speaks to the driver over the same channel as a local worker process (see
:mod:`lockstep._internal.wire.protocol`); Ray only places it, starts it, and tells the driver when
it ends. It runs its methods on two threads, so that the driver can ask where the train
function is (``stack``) while it runs.

With ``forker`` (see :mod:`lockstep._internal.ray_compat.ray_fork`), ``run`` has the node's warm
process fork the rank and waits for it instead: the train function then runs in that child.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from lockstep._internal.payload import deserialize_payload
from lockstep._internal.rank.forwarded_output import ForwardedOutput
from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS, RankEnv
from lockstep._internal.rank.worker import run_to_outcome
from lockstep._internal.ray_compat.ray_fork import ForkedRank, ForkRefused, NodeForker
from lockstep._internal.wire.channel import connect_to_driver
from lockstep._internal.wire.link_watch import DriverWatch

logger = logging.getLogger(__name__)

#: Frames of these files are the actor's plumbing, not the user's code.
PLUMBING = ("/lockstep/_internal/", "/ray/", "/threading.py", "/concurrent/futures/", "/multiprocessing/connection.py")


@dataclass(frozen=True)
class WorkerPlace:
    """Where an actor landed: its Ray node, that node's IP, the GPUs Ray gave it, its pid."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    pid: int


class RayWorker:
    """The actor class (the driver wraps it with ``ray.remote``)."""

    def __init__(self) -> None:
        self._train_thread: int | None = None
        self._clean = True
        self._forker: NodeForker | None = None  # this node's warm process, when this actor started it
        self._forked: ForkedRank | None = None  # the rank's process, while a forked run lasts

    def start_forker(self, modules: list[str]) -> str:
        """Start this node's warm process (once: a kept actor's still runs), importing
        ``modules`` besides torch; the name of its socket, for the node's ranks' ``run``."""
        if self._forker is None or not self._forker.alive():
            self._forker = NodeForker(modules)
        return self._forker.name

    def place(self) -> WorkerPlace:
        """Where this actor runs."""
        import ray

        context = ray.get_runtime_context()
        gpu_ids = tuple(str(gpu_id) for gpu_id in context.get_accelerator_ids().get("GPU", []))
        return WorkerPlace(context.get_node_id(), ray.util.get_node_ip_address(), gpu_ids, os.getpid())

    def free_port(self) -> int:
        """A TCP port that is free on this node now (rank 0's node hosts the rendezvous on it)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            return int(probe.getsockname()[1])

    def run(
        self,
        payload: bytes,
        env: dict[str, str],
        datasets: dict[str, Any],
        python_path: list[str],
        forker: str | None = None,
    ) -> int:
        """Run this rank to its end; return its exit code (0 when the train function returned).
        Afterwards the process is as the run found it (environment, import path, no process
        group, no session), so the driver may keep the actor for its next fit.

        Args:
            payload: The pickled :class:`~lockstep._internal.payload.TrainJob`.
            env: This rank's environment (rank variables, rendezvous, driver address, GPUs).
            datasets: This rank's shards of the Ray datasets.
            python_path: The driver's own import path entries; those that exist here are added.
            forker: The socket of the node's warm process: the rank runs in a process it forks.
        """
        if forker is not None:
            try:
                return self._run_forked(forker, payload, env, python_path)
            except ForkRefused as refusal:  # no rank process was made: run it here instead
                logger.warning("This rank runs in its Ray actor's process, not forked: %s", refusal)
        saved = RunLeftovers()
        self._clean = False
        try:
            return self._run(payload, env, datasets, python_path)
        finally:
            self._clean = saved.restore()

    def _run(self, payload: bytes, env: dict[str, str], datasets: dict[str, Any], python_path: list[str]) -> int:
        os.environ.update(env)
        sys.path[:0] = [entry for entry in python_path if os.path.isdir(entry) and entry not in sys.path]
        self._train_thread = threading.get_ident()
        rank_env = RankEnv.from_environ(env)
        channel = connect_to_driver(rank_env.world_rank, env)
        watch = DriverWatch(channel.fileno(), rank_env.world_rank, env[ENV_DRIVER_ADDRESS])
        with ForwardedOutput(channel, rank_env.world_rank), watch:
            outcome, exit_code = run_to_outcome(rank_env, channel, lambda: deserialize_payload(payload), datasets)
        try:
            channel.send(outcome)
        finally:
            channel.close()
            self._train_thread = None
        return exit_code

    def _run_forked(self, forker: str, payload: bytes, env: dict[str, str], python_path: list[str]) -> int:
        """Have the node's warm process fork the rank and wait for its end; its exit code.

        Raises:
            ForkRefused: the warm process refused (then no rank process exists).
            WarmProcessGone: the warm process ended or did not answer.
        """
        path_first = [entry for entry in python_path if os.path.isdir(entry)]
        self._forked = ForkedRank(forker, payload, {**os.environ, **env}, path_first)
        try:
            return self._forked.wait()
        finally:
            self._forked = None

    def ready(self) -> WorkerPlace:
        """Where this actor runs, once its last run left it clean (else a RuntimeError): the
        driver asks before it reuses the actor."""
        if not self._clean:
            raise RuntimeError("this actor's last run did not leave it clean; it must not be reused")
        return self.place()

    def stack(self) -> str:
        """The train function's current Python stack (most recent call last)."""
        forked = self._forked
        if forked is not None:
            return forked.stack()
        frame = sys._current_frames().get(self._train_thread) if self._train_thread is not None else None
        if frame is None:
            return ""
        lines = traceback.format_stack(frame)
        return "".join(line for line in lines if not any(part in line.splitlines()[0] for part in PLUMBING))


class RunLeftovers:
    """What a run changes in the actor's process, saved before it and put back after it: the
    environment, the import path, the ``report()`` session, the torch process group (the
    backend's shutdown leaves it; this is the safety net) and the job's objects."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.path = list(sys.path)

    def restore(self) -> bool:
        """Put the process back; whether that fully succeeded."""
        clean = True
        for name in [name for name in os.environ if name not in self.environ]:
            del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        sys.path[:] = self.path
        from lockstep._internal.rank.session_state import set_session

        set_session(None)
        torch = sys.modules.get("torch")
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001 - then the actor is not reused
                clean = False
        gc.collect()
        return clean
