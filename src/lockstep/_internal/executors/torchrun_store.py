"""What crosses torchrun's rendezvous store (see :mod:`lockstep._internal.executors.external`):
the store itself, the default run name, where rank 0's channel is (and the name of the file
holding its secret, never the secret), and how the run ended. Plain strings only."""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lockstep._internal.config_checks import check_run_name
from lockstep._internal.executors.shared_secret import read_secret
from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS, RankEnv
from lockstep._internal.run.run_names import default_run_name
from lockstep._internal.wire import network
from lockstep._internal.wire.channel import ENV_AUTHKEY, rank_credential
from lockstep.errors import ControllerError, error_class_named

if TYPE_CHECKING:
    from lockstep._internal.persist.storage import RunStorage

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
        that reaches MASTER_ADDR (see :func:`lockstep._internal.wire.network.own_address`)."""
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


def publish_channel(launch: Launch, store: Any, secret_file: str | None = None, error: str | None = None) -> None:
    """Rank 0 tells the other ranks which file of the run folder holds its secret and its
    channel's address (see :mod:`lockstep._internal.executors.shared_secret`), or why there is none."""
    entry = {"secret_file": secret_file} if secret_file is not None else {"error": error or "rank 0 could not start"}
    store.set(launch.key("channel"), json.dumps(entry))


def await_channel(launch: Launch, store: Any, storage: RunStorage) -> dict[str, str]:
    """The environment that connects this rank to rank 0's channel: its address and this rank's
    credential from the file rank 0 wrote into the run folder (the store only names the file).

    Raises:
        ControllerError: rank 0 could not start the run, or what the store says is not what
            rank 0 writes there.
    """
    store.wait([launch.key("channel")], STORE_WAIT)
    entry = json.loads(store.get(launch.key("channel")).decode())
    if "error" in entry:
        raise ControllerError(f"The run could not start (rank 0 says): {entry['error']}")
    try:
        channel = read_secret(storage, str(entry.get("secret_file")))
    except (ValueError, FileNotFoundError) as error:
        if isinstance(error, FileNotFoundError) and store.check(
            [launch.key("end")]
        ):  # rank 0 removed it: the run ended
            await_end(launch, store)
            raise ControllerError(f"The run ended before rank {launch.rank} could connect to it.") from error
        raise ControllerError(f"rank {launch.rank} can't open its channel to rank 0: {error}") from error
    return {ENV_DRIVER_ADDRESS: channel.address, ENV_AUTHKEY: rank_credential(channel.secret, launch.rank).hex()}


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
