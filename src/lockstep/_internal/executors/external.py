"""The external executor: the processes were started by torchrun (or a launcher that sets the same
variables), and ``fit()`` runs the train function in each of them, as its rank.

Every rank runs the usual worker runtime in its own main thread. Rank 0 also plays the driver:
a thread of it runs the controller, which the ranks (rank 0 included) reach over the usual
channel. The ranks find that channel, and the run's payload, through the rendezvous store that
torch.distributed uses anyway (torchrun's, or one that rank 0 opens on MASTER_ADDR:MASTER_PORT).
Restarts are torchrun's business (``--max-restarts``): lockstep's run name is derived from
torchrun's run id, so a restarted group continues the same run from its latest checkpoint.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from lockstep._internal import protocol
from lockstep._internal.executors.base import WorkerExited, WorkerGroup
from lockstep._internal.executors.channels import WorkerConnections
from lockstep._internal.worker import ENV_GPU_IDS, run_to_outcome
from lockstep.errors import TrainingFailedError

logger = logging.getLogger(__name__)

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
STORE_WAIT = datetime.timedelta(hours=24)


@dataclass(frozen=True)
class Launch:
    """This process's place in the group its launcher started."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    run_id: str
    restart: int


def launched_externally() -> Launch | None:
    """The launch variables when torchrun (or alike) started this process, else None. A lockstep
    worker (which has the same variables) is not an external launch."""
    if protocol.ENV_DRIVER_ADDRESS in os.environ or not all(name in os.environ for name in LAUNCHER_VARIABLES):
        return None
    return Launch(
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), local_rank=int(os.environ["LOCAL_RANK"]),
        master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
        run_id=os.environ.get("TORCHELASTIC_RUN_ID", "none"), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


def check_world_size(launch: Launch, scaling: Any) -> None:
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


def rendezvous_store(launch: Launch) -> Any:
    """The store every rank can reach: torchrun's agent store, else one rank 0 opens (which
    torch.distributed then joins instead of opening its own)."""
    from torch.distributed import TCPStore

    uses_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(
        launch.master_addr, launch.master_port, world_size=None, is_master=launch.rank == 0 and not uses_agent_store,
        timeout=datetime.timedelta(seconds=300), wait_for_workers=False,
    )
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return store


def store_key(launch: Launch, name: str) -> str:
    return f"lockstep/{launch.run_id}/{launch.restart}/{name}"


def publish_host(launch: Launch) -> str:
    """The address other ranks use to reach rank 0's listener."""
    return os.environ.get("LOCKSTEP_EXTERNAL_HOST") or launch.master_addr


class ExternalGroup(WorkerGroup):
    """The ranks torchrun started, as rank 0's controller sees them: it starts and stops nothing;
    a rank whose channel closes has ended."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.channels = WorkerConnections("0.0.0.0")
        self._seen: set[int] = set()
        self._ended: set[int] = set()

    def start(self, payload: bytes) -> None:
        """Nothing to start: the ranks are already running."""

    def wait_events(self, timeout: float | None) -> list[Any]:
        """What the ranks sent; a WorkerExited for each rank whose channel has closed."""
        events: list[Any] = []
        for ready in wait(self.channels.waitables(), timeout):
            events += self.channels.read(ready)
        self._seen |= {event.rank for event in events if isinstance(event, protocol.Hello)}
        for rank in sorted(self._seen - self._ended - self.channels.connected_ranks()):
            self._ended.add(rank)
            events.append(WorkerExited(rank, 0, "its process closed its channel to rank 0 (it exited or crashed)"))
        return events

    def send(self, rank: int, message: Any) -> None:
        self.channels.send(rank, message)

    def stop(self) -> None:
        """Close the channels: ranks waiting in report() then fail."""
        self.channels.close()


def run_rank_here(launch: Launch, store: Any, use_gpu: bool) -> tuple[Any, int]:
    """Connect to rank 0's channel and run this rank (in this process); return its outcome."""
    address = store.get(store_key(launch, "driver")).decode()
    authkey = store.get(store_key(launch, "authkey")).decode()
    payload = store.get(store_key(launch, "payload"))
    if use_gpu:
        os.environ[ENV_GPU_IDS] = str(launch.local_rank)
    env = {protocol.ENV_DRIVER_ADDRESS: address, protocol.ENV_AUTHKEY: authkey}
    os.environ.update(NODE_RANK=os.environ.get("GROUP_RANK", "0"), LOCKSTEP_STORE_PREFIX=store_key(launch, "pg"))
    channel = protocol.connect_to_driver(env)
    channel.send(protocol.Hello(launch.rank, os.getpid()))
    outcome, exit_code = run_to_outcome(launch.rank, channel, lambda: payload)
    try:
        channel.send(outcome)
    except OSError:
        pass
    finally:
        channel.close()
    return outcome, exit_code


def serve_as_driver(launch: Launch, store: Any, group: ExternalGroup, payload: bytes) -> None:
    """Rank 0: publish where the channel is and what to run."""
    host, port = publish_host(launch), group.channels.listener.address[1]
    store.set(store_key(launch, "driver"), f"{host}:{port}")
    store.set(store_key(launch, "authkey"), group.channels.listener.authkey.hex())
    store.set(store_key(launch, "payload"), payload)


class ControllerThread(threading.Thread):
    """Runs the controller on rank 0, beside the train function."""

    def __init__(self, controller: Any, payload: bytes) -> None:
        super().__init__(daemon=True, name="lockstep-controller")
        self.controller = controller
        self.payload = payload
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.controller.run(self.payload)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self.error = error


def shared_run_name(launch: Launch, store: Any, trainer_name: str) -> str:
    """One default run name for every rank: from torchrun's run id when it has one (so a group
    that torchrun restarts continues the same run), else made by rank 0 and shared."""
    if launch.run_id not in ("", "none"):
        return f"{trainer_name}_{launch.run_id}"
    key = f"lockstep/name/{launch.master_port}"
    if launch.rank == 0:
        from lockstep.trainer import default_run_name

        store.set(key, default_run_name(trainer_name))
    store.wait([key], STORE_WAIT)
    return store.get(key).decode()


def drive_and_run_rank_0(launch: Launch, store: Any, group: ExternalGroup, controller: Any, payload: bytes,
                         use_gpu: bool) -> Any:
    """Rank 0: run the controller on a thread, this rank's train function here, and tell the
    other ranks how the run ended."""
    serve_as_driver(launch, store, group, payload)
    thread = ControllerThread(controller, payload)
    thread.start()
    run_rank_here(launch, store, use_gpu)
    thread.join()
    announce_end(launch, store, thread.error)
    if thread.error is not None:
        raise thread.error
    return thread.result


def run_rank_or_raise(launch: Launch, store: Any, use_gpu: bool) -> None:
    """Another rank: run it; if its train function failed, raise at once (the process then
    exits, and torchrun stops the group), without waiting for rank 0.

    Raises:
        TrainingFailedError: this rank's train function raised.
    """
    outcome, exit_code = run_rank_here(launch, store, use_gpu)
    if exit_code != 0:
        raise TrainingFailedError.from_failures([outcome.failure])


def announce_end(launch: Launch, store: Any, error: BaseException | None) -> None:
    """Rank 0 tells the other ranks how the run ended."""
    store.set(store_key(launch, "end"), "" if error is None else f"{type(error).__name__}: {error}")


def await_end(launch: Launch, store: Any) -> None:
    """The other ranks wait for rank 0's word on the run.

    Raises:
        TrainingFailedError: the run failed.
    """
    store.wait([store_key(launch, "end")], STORE_WAIT)
    message = store.get(store_key(launch, "end")).decode()
    if message:
        raise TrainingFailedError(f"The run failed (rank 0 says): {message}")
