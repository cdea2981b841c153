"""The external executor: the processes were started by torchrun (or a launcher that sets the
same variables), and each one runs the train function it built itself, as its rank: a value
its script computed at module level (its ``LOCAL_RANK``, its device, an open file) is its own.

Rank 0 also drives the run: a thread of it runs the controller, which every rank (rank 0
included) reaches over the usual channel. Only what rank 0 decides crosses between ranks:

- through the rendezvous store (torchrun's, or one rank 0 opens on MASTER_ADDR:MASTER_PORT):
  the default run name, the channel's address, the name of the file in the run folder that
  holds the channel's secret (never the secret: see
  :mod:`lockstep._internal.executors.shared_secret`), and how the run ended — plain strings;
- over the channel (JSON messages, see :mod:`lockstep._internal.protocol`): where the attempt
  starts (first report index, checkpoint) and the report barrier.

No pickle travels through the store, and what it holds does not open a channel: a peer that
reaches the store alone can't speak to rank 0's controller, let alone run code. Restarts are
torchrun's business (``--max-restarts``): the run name is derived from torchrun's run id, so a
restarted group continues the same run from its latest checkpoint.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lockstep._internal import network, protocol
from lockstep._internal.channel import ENV_AUTHKEY, connect_to_driver, rank_credential
from lockstep._internal.config_checks import check_run_name
from lockstep._internal.executors.base import Executor
from lockstep._internal.executors.channels import AttachedGroup
from lockstep._internal.executors.shared_secret import read_secret, remove_secret, write_secret
from lockstep._internal.link_watch import LOST_EXIT_CODE, STUCK_GRACE_S, DriverWatch
from lockstep._internal.preemption import RANK_HANGUP, HangUp, Preemption, PreemptionStop, hung_up, rank_signals
from lockstep._internal.rank_env import ENV_DRIVER_ADDRESS, RankEnv
from lockstep._internal.run_names import default_run_name
from lockstep._internal.session_state import current_session
from lockstep._internal.worker import run_to_outcome
from lockstep._internal.worker_group import GroupFactory
from lockstep.errors import ControllerError, PreemptionError, WorkerGroupError, error_class_named

if TYPE_CHECKING:
    from lockstep._internal.driver import RunDriver
    from lockstep._internal.payload import TrainJob
    from lockstep._internal.storage import RunStorage
    from lockstep.config import ScalingConfig
    from lockstep.result import Result

logger = logging.getLogger(__name__)

STORE_WAIT = datetime.timedelta(hours=24)


@dataclass(frozen=True)
class Launch:
    """This process's place in the group its launcher started."""

    rank_env: RankEnv
    run_id: str
    restart: int

    @classmethod
    def from_environ(cls) -> Launch:
        """The launch the launcher's variables describe; this node's address is the local one
        that reaches MASTER_ADDR (see :func:`lockstep._internal.network.own_address`)."""
        rank_env = RankEnv.from_environ(os.environ)
        if rank_env.node_addr is None:
            multi_node = rank_env.world_size > rank_env.local_world_size
            rank_env = replace(
                rank_env, node_addr=network.own_address(rank_env.master_addr, rank_env.master_port, multi_node)
            )
        return cls(
            rank_env,
            os.environ.get("TORCHELASTIC_RUN_ID", "none"),
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )

    @property
    def rank(self) -> int:
        """This process's world rank."""
        return self.rank_env.world_rank

    @property
    def world_size(self) -> int:
        """Number of processes the launcher started."""
        return self.rank_env.world_size

    def key(self, name: str) -> str:
        """A store key of this attempt of the launcher's run."""
        return f"lockstep/{self.run_id}/{self.restart}/{name}"


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
        try:
            controller = driver.prepare(GroupFactory(self.name, lambda _: group, size, size), restarts=False)
            secret_file = write_secret(job.storage, group.listener.secret)
        except BaseException as error:
            group.stop()
            publish_channel(self.launch_info, self.store, error=f"{type(error).__name__}: {error}")
            raise
        try:
            publish_channel(self.launch_info, self.store, group=group, secret_file=secret_file)
            thread = ControllerThread(
                lambda: driver.drive(controller), lambda error: announce_end(self.launch_info, self.store, error)
            )
            thread.start()
            try:
                self._run_rank(job, group.keep_return_value, controller.preemption)
            finally:
                thread.rank_done.set()
            thread.join()
        finally:
            remove_secret(job.storage, secret_file)
        announce_end(self.launch_info, self.store, thread.error)
        if thread.error is not None:
            raise thread.error
        return thread.result

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
            gpu_ids=(str(launch.rank_env.local_rank),) if self.use_gpu else (),
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


class ControllerThread(threading.Thread):
    """Drives the run on rank 0, beside its train function. With ``announce`` (under torchrun):
    when the run has ended and rank 0's train function does not end within ``STUCK_GRACE_S``
    (it waits in a collective for a rank on a lost host: nothing can interrupt it), the thread
    reports the run's end with ``announce`` and ends the process, saying why.

    Attributes:
        rank_done: Set by the main thread once rank 0's train function has ended.
    """

    def __init__(
        self, drive: Callable[[], Result], announce: Callable[[BaseException | None], None] | None = None
    ) -> None:
        super().__init__(daemon=True, name="lockstep-controller")
        self.drive = drive
        self.announce = announce
        self.rank_done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.drive()
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self.error = error
        if self.announce is not None and not self.rank_done.wait(STUCK_GRACE_S):
            self._end_stuck_rank(self.announce)

    def _end_stuck_rank(self, announce: Callable[[BaseException | None], None]) -> None:
        logger.error(
            "The run has ended (%s), but rank 0's train function has not returned %g s later (it is most "
            "likely waiting in a collective for a rank that is gone). This process exits now (code %d).",
            "succeeded" if self.error is None else f"{type(self.error).__name__}: {self.error}",
            STUCK_GRACE_S,
            LOST_EXIT_CODE,
        )
        try:
            announce(self.error)
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(LOST_EXIT_CODE)


# -- what crosses the store -----------------------------------------------------------------------


def rendezvous_store(launch: Launch) -> Any:
    """The store every rank can reach: torchrun's agent store, else one rank 0 opens (which
    torch.distributed then joins instead of opening its own)."""
    from torch.distributed import TCPStore

    uses_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(
        launch.rank_env.master_addr,
        launch.rank_env.master_port,
        world_size=None,
        is_master=launch.rank == 0 and not uses_agent_store,
        timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
    )
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return store


def shared_run_name(launch: Launch, store: Any, trainer_name: str) -> str:
    """One default run name for every rank: from torchrun's run id when it has one (so a group
    that torchrun restarts continues the same run), else made by rank 0 and shared."""
    if launch.run_id not in ("", "none"):
        return f"{trainer_name}_{launch.run_id}"
    key = f"lockstep/name/{launch.rank_env.master_port}"
    if launch.rank == 0:
        store.set(key, default_run_name(trainer_name))
    store.wait([key], STORE_WAIT)
    name = store.get(key).decode()
    try:
        check_run_name(name)
    except ValueError as error:
        raise ControllerError(f"torchrun's rendezvous store holds a run name lockstep never makes: {error}") from error
    return name


def publish_host(launch: Launch) -> str:
    """The address other ranks use to reach rank 0's channel: ``LOCKSTEP_EXTERNAL_HOST`` when
    set, else rank 0's node address (which reaches MASTER_ADDR), else MASTER_ADDR."""
    return os.environ.get("LOCKSTEP_EXTERNAL_HOST") or launch.rank_env.node_addr or launch.rank_env.master_addr


def publish_channel(
    launch: Launch,
    store: Any,
    group: AttachedGroup | None = None,
    secret_file: str | None = None,
    error: str | None = None,
) -> None:
    """Rank 0 tells the other ranks where its channel is and which file of the run folder holds
    its secret (see :mod:`lockstep._internal.executors.shared_secret`), or why there is none."""
    if group is not None:
        entry = {"address": f"{publish_host(launch)}:{group.listener.address[1]}", "secret_file": secret_file}
    else:
        entry = {"error": error or "rank 0 could not start the run"}
    store.set(launch.key("channel"), json.dumps(entry))


def await_channel(launch: Launch, store: Any, storage: RunStorage) -> dict[str, str]:
    """The environment that connects this rank to rank 0's channel: its address from the
    store, this rank's credential from the secret rank 0 wrote into the run folder.

    Raises:
        ControllerError: rank 0 could not start the run, or what the store says is not what
            rank 0 writes there.
    """
    store.wait([launch.key("channel")], STORE_WAIT)
    entry = json.loads(store.get(launch.key("channel")).decode())
    if "error" in entry:
        raise ControllerError(f"The run could not start (rank 0 says): {entry['error']}")
    try:
        secret = read_secret(storage, str(entry.get("secret_file")))
    except (ValueError, FileNotFoundError) as error:
        if isinstance(error, FileNotFoundError) and store.check(
            [launch.key("end")]
        ):  # rank 0 removed it: the run ended
            await_end(launch, store)
            raise ControllerError(f"The run ended before rank {launch.rank} could connect to it.") from error
        raise ControllerError(f"rank {launch.rank} can't open its channel to rank 0: {error}") from error
    return {ENV_DRIVER_ADDRESS: str(entry["address"]), ENV_AUTHKEY: rank_credential(secret, launch.rank).hex()}


def announce_end(launch: Launch, store: Any, error: BaseException | None) -> None:
    """Rank 0 tells the other ranks how the run ended."""
    store.set(launch.key("end"), "" if error is None else f"{type(error).__name__}: {error}")


def await_end(launch: Launch, store: Any) -> None:
    """The other ranks wait for rank 0's word on the run.

    Raises:
        TrainingFailedError: the run failed: the class rank 0's error had (WorkerGroupError or
            ControllerError), without its per-rank failures, which rank 0 alone holds.
    """
    store.wait([launch.key("end")], STORE_WAIT)
    message = store.get(launch.key("end")).decode()
    if message:
        raise error_class_named(message.split(":", 1)[0])(f"The run failed (rank 0 says): {message}")
