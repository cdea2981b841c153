"""The external executor: the processes were started by torchrun (or a launcher that sets the
same variables), and each one runs the train function it built itself, as its rank: a value
its script computed at module level (its ``LOCAL_RANK``, its device, an open file) is its own.

Rank 0 also drives the run: a thread of it runs the controller, which every rank (rank 0
included) reaches over the usual channel. Only what rank 0 decides crosses between ranks:

- through the rendezvous store (torchrun's, or one rank 0 opens on MASTER_ADDR:MASTER_PORT):
  the default run name, the channel's address, the name of the file in the run folder that
  holds the channel's secret (never the secret: see
  :mod:`lockstep._internal.executors.shared_secret`), and how the run ended — plain strings;
- over the channel (JSON messages, see :mod:`lockstep._internal.wire.protocol`): where the attempt
  starts (first report index, checkpoint) and the report barrier.

No pickle travels through the store, and what it holds does not open a channel: a peer that
reaches the store alone can't speak to rank 0's controller, let alone run code. Restarts are
torchrun's business (``--max-restarts``): the run name is derived from torchrun's run id, so a
restarted group continues the same run from its latest checkpoint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lockstep._internal.executors.attached_group import AttachedGroup
from lockstep._internal.executors.base import Executor
from lockstep._internal.executors.beside import drive_beside_rank_0
from lockstep._internal.executors.shared_secret import remove_secret, write_secret
from lockstep._internal.executors.torchrun_store import (
    Launch,
    announce_end,
    await_channel,
    await_end,
    publish_channel,
    publish_host,
    rendezvous_store,
    shared_run_name,
)
from lockstep._internal.rank.devices import gpu_of_local_rank
from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS
from lockstep._internal.rank.session_state import current_session
from lockstep._internal.rank.worker import run_to_outcome
from lockstep._internal.run.preemption import RANK_HANGUP, HangUp, Preemption, PreemptionStop, hung_up, rank_signals
from lockstep._internal.wire import protocol
from lockstep._internal.wire.channel import connect_to_driver
from lockstep._internal.wire.link_watch import DriverWatch
from lockstep.errors import PreemptionError, WorkerGroupError

if TYPE_CHECKING:
    from lockstep._internal.payload import TrainJob
    from lockstep._internal.run.controller import Controller
    from lockstep._internal.run.driver import RunDriver
    from lockstep.config import ScalingConfig
    from lockstep.result import Result

logger = logging.getLogger(__name__)


class ExternalExecutor(Executor):
    """The processes a launcher started; rank 0 drives the run."""

    name = "external"

    def __init__(self, launch: Launch, use_gpu: bool) -> None:
        self.launch_info = launch
        self.use_gpu = use_gpu
        self._store: Any = None

    @classmethod
    def from_environ(cls, scaling: ScalingConfig, ray_datasets: Any) -> ExternalExecutor:
        """The executor for this launched process.

        Raises:
            ValueError: ``scaling`` doesn't allow the launcher's world size, or Ray Datasets
                were passed (they need the Ray executor).
        """
        launch = Launch.from_environ()
        check_world_size(launch, scaling)
        if ray_datasets:
            raise ValueError("Ray Datasets need the Ray executor; under torchrun pass torch datasets.")
        return cls(launch, scaling.use_gpu)

    @property
    def store(self) -> Any:
        """The rendezvous store every rank reaches (opened on first use)."""
        if self._store is None:
            self._store = rendezvous_store(self.launch_info)
        return self._store

    def run_name(self, configured: str | None, trainer_name: str) -> str:
        """``RunConfig.name``, else one name for every rank (see :func:`shared_run_name`)."""
        return configured or shared_run_name(self.launch_info, self.store, trainer_name)

    def launch(self, job: TrainJob, driver: RunDriver) -> Result:
        """Run this process's rank; on rank 0 also drive the run. Every rank returns the
        run's Result.

        Raises:
            WorkerGroupError: this rank's train function failed, or (as rank 0 says) the run.
            ControllerError: (as rank 0 says) the driver could not go on.
        """
        if self.launch_info.rank == 0:
            return self._drive_and_run_rank_0(job, driver)
        outcome, exit_code, sigterms = self._run_rank(job)
        if hung_up(outcome):  # torchrun passed its SIGHUP on: rank 0 records the run as interrupted
            raise HangUp(RANK_HANGUP)
        if exit_code != 0 and not (sigterms or stopped_preempted(outcome)):
            raise WorkerGroupError.from_failures([outcome.failure])
        try:
            await_end(self.launch_info, self.store)
        except PreemptionError as error:  # as rank 0 says; with the notice this rank got
            session = current_session()
            error.preemption_info = session.preemption_info if session is not None else None
            raise
        from lockstep.result import Result

        return Result.from_path(job.storage.run_path, job.storage.filesystem)

    def _drive_and_run_rank_0(self, job: TrainJob, driver: RunDriver) -> Result:
        size = self.launch_info.world_size
        group = AttachedGroup(
            "0.0.0.0", size, "its process closed its channel to rank 0: it exited or crashed", name_hosts=True
        )
        secret_files: list[str] = []

        def publish(controller: Controller) -> None:
            address = f"{publish_host(self.launch_info)}:{group.listener.address[1]}"
            secret_files.append(write_secret(job.storage, group.listener.secret, address))
            publish_channel(self.launch_info, self.store, secret_file=secret_files[0])

        def refuse(error: BaseException) -> None:
            publish_channel(self.launch_info, self.store, error=f"{type(error).__name__}: {error}")

        try:
            _, thread = drive_beside_rank_0(
                driver,
                self.name,
                group,
                lambda controller: self._run_rank(job, group.keep_return_value, controller.preemption),
                announce=lambda error: announce_end(self.launch_info, self.store, error),
                prepared=publish,
                failed_to_prepare=refuse,
            )
        finally:
            for name in secret_files:
                remove_secret(job.storage, name)
        announce_end(self.launch_info, self.store, thread.error)
        return thread.outcome()

    def _run_rank(
        self,
        job: TrainJob,
        keep_return_value: Callable[[Any], None] | None = None,
        preemption: Preemption | None = None,
    ) -> tuple[Any, int, int]:
        """Connect to rank 0's channel and run this rank's own job here; return its outcome, its
        exit code and how many SIGTERMs (preemption notices) it got meanwhile. A SIGHUP raises
        HangUp in the train function (on rank 0, after telling its controller's ``preemption``)."""
        launch = self.launch_info
        channel_env = await_channel(launch, self.store, job.storage)
        rank_env = replace(
            launch.rank_env,
            store_is_hosted=True,
            store_prefix=launch.key("pg"),
            gpu_ids=(gpu_of_local_rank(launch.rank_env.local_rank),) if self.use_gpu else (),
        )
        os.environ.update(rank_env.variables())
        channel = connect_to_driver(launch.rank, channel_env)
        watch = (
            nullcontext()
            if launch.rank == 0
            else DriverWatch(channel.fileno(), launch.rank, channel_env[ENV_DRIVER_ADDRESS])
        )
        # torchrun forwards its SIGTERM (a notice) and its SIGHUP (HangUp) to every rank
        with rank_signals(channel, launch.rank, hang_up=True, controller=preemption) as signals, watch:
            outcome, exit_code = run_to_outcome(rank_env, channel, lambda: job, keep_return_value=keep_return_value)
        try:
            channel.send(outcome)
        except OSError:
            pass
        finally:
            channel.close()
        return outcome, exit_code, signals.received


def stopped_preempted(outcome: Any) -> bool:
    """Whether a rank's outcome is the stop of a preempted run (not a failure of its own)."""
    return isinstance(outcome, protocol.Failed) and outcome.failure.error_type == PreemptionStop.__name__


def check_world_size(launch: Launch, scaling: ScalingConfig) -> None:
    """The group the launcher started must be one the ScalingConfig allows.

    Raises:
        ValueError: it is not.
    """
    if not scaling.min_workers <= launch.world_size <= scaling.max_workers:
        raise ValueError(
            f"This process was started by torchrun (or alike) as rank {launch.rank} of {launch.world_size}, but "
            f"ScalingConfig(num_workers={scaling.num_workers}): under torchrun, lockstep runs the train function in "
            f"the processes torchrun started, so num_workers must be {launch.world_size} (or start torchrun with "
            f"--nproc_per_node / --nnodes giving {scaling.num_workers} processes)."
        )
