"""Who may speak on a run's channel: each rank only as itself, nothing unpickled from an unproven
peer, and under torchrun nothing in the rendezvous store that opens a channel. The rogue peer
(tests/scripts/rogue_peer.py) is tried on the local executor here, on Ray in test_ray.py, and
under torchrun here."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_scripts import SCRIPTS, torchrun

import lockstep
from lockstep import RunConfig, ScalingConfig, TrainingFailedError
from lockstep._internal.executors.channels import WorkerConnections
from lockstep._internal.executors.shared_secret import SECRET_FOLDER, read_secret, write_secret
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.wire import channel, codec, protocol
from lockstep.collective import broadcast_from_rank_zero
from lockstep.torch import TorchTrainer

ROGUE = str(SCRIPTS / "rogue_peer.py")


class CreatesMarker:
    """Unpickling this creates ``path``: proof that a pickle was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


# -- the listener, with real sockets ------------------------------------------------------------


def pump(connections: WorkerConnections, seconds: float, until: Any = None) -> list[Any]:
    """Run the driver's side for up to ``seconds`` (less once ``until(events)`` holds); the events read."""
    events: list[Any] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until is not None and until(events)):
        events += connections.wait(min(0.05, max(0.0, deadline - time.monotonic())))[0]
    return events


def connect_in_thread(connections: WorkerConnections, rank: int, env: dict[str, str]) -> Any:
    """Connect as ``rank`` while the driver side runs; (the worker's channel or the error, the events read)."""
    import threading

    outcome: dict[str, Any] = {}

    def connect() -> None:
        try:
            outcome["channel"] = channel.connect_to_driver(rank, env)
        except (OSError, EOFError) as error:
            outcome["channel"] = error

    thread = threading.Thread(target=connect)
    thread.start()
    events = pump(connections, 30, until=lambda _: not thread.is_alive())
    thread.join(30)
    if isinstance(outcome["channel"], channel.WorkerChannel):  # its proof may still be on the way
        events += pump(
            connections, 30, until=lambda more: any(isinstance(event, protocol.Hello) for event in events + more)
        )
    return outcome["channel"], events


@pytest.fixture
def connections() -> Any:
    group = WorkerConnections("127.0.0.1", 2)
    try:
        yield group
    finally:
        group.close()


def test_a_rank_connects_with_its_own_credential_once(connections: WorkerConnections) -> None:
    worker, events = connect_in_thread(connections, 1, connections.worker_env(1))
    assert isinstance(worker, channel.WorkerChannel) and [type(event) for event in events] == [protocol.Hello]
    again, events = connect_in_thread(connections, 1, connections.worker_env(1))
    assert isinstance(again, channel.ChannelRefused) and "rank 1" in str(again) and events == []
    assert connections.connected_ranks() == {1}
    worker.close()


def test_a_rank_outside_the_group_or_another_ranks_credential_is_refused(
    connections: WorkerConnections,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        outside, events = connect_in_thread(connections, 7, connections.worker_env(1))
        assert isinstance(outside, channel.ChannelRefused) and events == []
        wrong, events = connect_in_thread(connections, 0, connections.worker_env(1))
        assert isinstance(wrong, channel.ChannelRefused) and events == []
    assert "claims rank 7, but this group has ranks 0-1" in caplog.text
    assert connections.connected_ranks() == set()
    right, _ = connect_in_thread(connections, 0, connections.worker_env(0))  # the refusals took nothing from rank 0
    assert isinstance(right, channel.WorkerChannel)
    right.close()


def test_every_rank_gets_a_different_credential_and_none_is_the_secret(connections: WorkerConnections) -> None:
    credentials = {connections.worker_env(rank)[channel.ENV_AUTHKEY] for rank in range(2)}
    assert len(credentials) == 2 and connections.listener.secret.hex() not in credentials


@pytest.mark.parametrize(
    "message",
    [
        protocol.Finished(0, b"pickle"),
        protocol.Collective(0, 0, "broadcast", b"pickle"),
        protocol.Failed(lockstep.errors.WorkerFailure(0, "ValueError", "not mine")),
        protocol.ReportDone(0),
        protocol.Hello(1, 1),
    ],
)
def test_a_message_claiming_another_rank_closes_the_channel(connections: WorkerConnections, message: Any) -> None:
    worker, _ = connect_in_thread(connections, 1, connections.worker_env(1))
    worker.send(protocol.Report(1, 0, None))
    worker.send(message)
    events = connections.drain_rank(1, until_closed_s=5)
    assert isinstance(events[0], protocol.Report)
    (failure,) = [event.failure for event in events[1:]]
    assert failure.rank == 1 and failure.error_type == "ChannelViolation"
    assert connections.connected_ranks() == set()
    worker.close()


def test_a_garbage_hello_is_refused_without_a_challenge(connections: WorkerConnections) -> None:
    with socket.create_connection(connections.listener.address, timeout=30) as raw:
        raw.sendall(b"\x00\x00\x00\x0f\x80\x04pickled-stuff")
        assert pump(connections, 1.0) == []
        with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread: refused too
            assert raw.recv(1024) == b"", "the driver answered a garbage Hello"


# -- a rogue peer during a real run --------------------------------------------------------------


def rogue_peer_train_func(config: dict[str, Any]) -> str:
    """Rank 1 starts the rogue peer with its own environment; then every rank reports and rank
    0 broadcasts, as in a healthy run."""
    if lockstep.get_context().get_world_rank() == 1:
        subprocess.run(
            [sys.executable, config["rogue"], "env", config["out"], config["marker"]], check=True, timeout=90
        )
    lockstep.report({"reported": 1})
    shared = broadcast_from_rank_zero({"from": "rank 0"})
    lockstep.report({"broadcast": shared["from"]})
    return "rank 0's own value"


def rogue_config(tmp_path: Path) -> dict[str, str]:
    return {"rogue": ROGUE, "out": str(tmp_path / "rogue.json"), "marker": str(tmp_path / "MARKER")}


def assert_rogue_refused(outcome_file: str, marker: str) -> None:
    outcomes = json.loads(Path(outcome_file).read_text())
    assert outcomes == {
        "fake rank 7": "refused",
        "rank 1 again": "refused",
        "rank 0 with another rank's credential": "refused",
    }
    assert not os.path.exists(marker), "a rogue peer's pickle was loaded"


@pytest.mark.timeout(120)
def test_a_rogue_peer_with_a_ranks_credential_runs_nothing_on_the_local_executor(
    tmp_path: Path,
    storage_path: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = rogue_config(tmp_path)
    with caplog.at_level(logging.WARNING):
        result = TorchTrainer(
            rogue_peer_train_func,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=storage_path, verbose=0),
        ).fit()
    assert_rogue_refused(config["out"], config["marker"])
    assert result.return_value == "rank 0's own value" and result.metrics["broadcast"] == "rank 0"
    assert "claims rank 7, but this group has ranks 0-1" in caplog.text
    assert "claims rank 1, which has connected to this group already" in caplog.text


def rank_1_claims_rank_0_train_func(config: dict[str, Any]) -> None:
    """Rank 1 sends a pickled broadcast for rank 0 on its own (real) channel."""
    from lockstep._internal.rank.session_state import current_session

    if lockstep.get_context().get_world_rank() == 1:
        session = current_session()
        assert session is not None
        session._channel.send(protocol.Collective(0, 0, "broadcast", pickle.dumps(CreatesMarker(config["marker"]))))
    broadcast_from_rank_zero("rank 0's object")


@pytest.mark.timeout(120)
def test_a_rank_that_speaks_as_rank_0_fails_the_run_and_nothing_is_unpickled(tmp_path: Path, storage_path: str) -> None:
    marker = str(tmp_path / "MARKER")
    trainer = TorchTrainer(
        rank_1_claims_rank_0_train_func,
        train_loop_config={"marker": marker},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, verbose=0),
    )
    with pytest.raises(
        TrainingFailedError,
        match=r"(?s)rank 1: ChannelViolation: rank 1 sent a Collective that claims "
        r"to come from rank 0",
    ):
        trainer.fit()
    assert not os.path.exists(marker), "a pickle sent as another rank was loaded"


# -- torchrun: the store is not a key ------------------------------------------------------------


@pytest.mark.timeout(180)
def test_under_torchrun_a_reader_of_the_store_cannot_connect_and_no_rogue_runs_code(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    completed = torchrun(
        "--max-restarts=0", str(SCRIPTS / "rogue_torchrun_job.py"), str(tmp_path / "results"), str(out_dir), timeout=150
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    store = json.loads((out_dir / "store.json").read_text())
    assert store["entry keys"] == ["secret_file"], "the store holds more than the name of the secret's file"
    assert all(outcome == "refused" for name, outcome in store.items() if name != "entry keys"), store
    assert_rogue_refused(str(out_dir / "env.json"), str(out_dir / "MARKER"))
    results = [
        json.loads(line.split(" RESULT ", 1)[1]) for line in completed.stdout.splitlines() if line.startswith("RANK ")
    ]
    assert len(results) == 2 and all(
        result["error"] is None and result["metrics"]["broadcast"] == "rank 0" for result in results
    )
    assert not list((tmp_path / "results" / "rogue" / SECRET_FOLDER).iterdir()), "rank 0 left the secret file behind"


def test_the_secret_file_is_private_and_its_name_is_checked(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path / "run"))
    name = write_secret(storage, b"s" * 32, "10.0.0.1:4242")
    path = tmp_path / "run" / SECRET_FOLDER / name
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_secret(storage, name) == (b"s" * 32, "10.0.0.1:4242")
    with pytest.raises(ValueError, match="something else wrote to torchrun's store"):
        read_secret(storage, "../../etc/passwd")
    with pytest.raises(FileNotFoundError, match="every rank must see the same"):
        read_secret(storage, "channel-" + "0" * 32 + ".key")


# -- found in review: what an unproven or duplicate peer, or a store writer, could do ------------


def handshake_frame(payload: bytes) -> bytes:
    from lockstep._internal.wire.frames import frame

    return frame(payload)


def test_a_deeply_nested_hello_or_a_non_ascii_proof_is_refused_and_the_driver_goes_on(
    connections: WorkerConnections,
) -> None:
    with socket.create_connection(connections.listener.address, timeout=30) as nested:
        nested.sendall(handshake_frame(b"[" * 3000))  # json's recursion limit, inside the 4 KiB bound
        assert pump(connections, 1.0) == []
    with socket.create_connection(connections.listener.address, timeout=30) as raw:
        raw.sendall(handshake_frame(codec.encode(protocol.Hello(0, 1, "rogue", os.urandom(32).hex()))))
        assert pump(connections, 1.0) == [] and raw.recv(4096), "no Challenge came"
        raw.sendall(handshake_frame(json.dumps({"~type": "Proof", "proof": "\u00e9" * 64}).encode()))
        assert pump(connections, 1.0) == []
    right, _ = connect_in_thread(connections, 0, connections.worker_env(0))
    assert isinstance(right, channel.WorkerChannel), "the driver's loop did not survive the rogue handshakes"
    right.close()


def test_two_handshakes_for_one_rank_open_one_channel(connections: WorkerConnections) -> None:
    from multiprocessing.connection import Connection

    credential = connections.listener.credential(1)
    opened = []
    for pid in (100, 101):
        worker = Connection(socket.create_connection(connections.listener.address, timeout=30).detach())
        nonce = os.urandom(32)
        worker.send_bytes(codec.encode(protocol.Hello(1, pid, "host", nonce.hex())))
        opened.append((worker, nonce))
    events = pump(connections, 0.5)
    for worker, nonce in opened:  # both prove rank 1 before either channel is open
        challenge = codec.decode(worker.recv_bytes())
        proof = channel._proof(credential, channel._RANK_LABEL, bytes.fromhex(challenge.nonce), nonce)
        worker.send_bytes(codec.encode(protocol.Proof(proof)))
    events += pump(connections, 1.0)
    assert [event.pid for event in events if isinstance(event, protocol.Hello)] == [100]
    for worker, _ in opened:
        worker.close()


def test_a_failed_message_without_a_failure_closes_the_channel(connections: WorkerConnections) -> None:
    worker, _ = connect_in_thread(connections, 1, connections.worker_env(1))
    worker._connection.send_bytes(json.dumps({"~type": "Failed", "failure": {"rank": 1}}).encode())
    events = connections.drain_rank(1, until_closed_s=5)
    assert [event.failure.error_type for event in events] == ["ChannelViolation"]
    worker.close()


def test_a_rank_gives_up_on_a_listener_that_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel, "RANK_HANDSHAKE_WAIT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        env = {channel.ENV_DRIVER_ADDRESS: f"127.0.0.1:{silent.getsockname()[1]}", channel.ENV_AUTHKEY: "00" * 32}
        started = time.monotonic()
        with pytest.raises(channel.ChannelRefused, match="no answer to this rank's Hello within 0.5 s"):
            channel.connect_to_driver(1, env)
    assert time.monotonic() - started < 10


class StoreOf:
    """torchrun's store as await_channel reads it (what a store writer may have rewritten)."""

    def __init__(self, entries: dict[str, str]) -> None:
        self.entries = entries

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        assert all(key in self.entries for key in keys)

    def get(self, key: str) -> bytes:
        return self.entries[key].encode()

    def check(self, keys: list[str]) -> bool:
        return all(key in self.entries for key in keys)


class LaunchOf:
    rank = 1

    def key(self, name: str) -> str:
        return f"test/{name}"


def test_under_torchrun_the_channel_address_comes_from_the_run_folder_not_the_store(tmp_path: Path) -> None:
    from lockstep._internal.executors.torchrun_store import await_channel

    storage = RunStorage(str(tmp_path / "run"))
    name = write_secret(storage, b"s" * 32, "10.0.0.1:4242")
    rewritten = json.dumps({"secret_file": name, "address": "attacker.example:1"})  # a store writer's entry
    env = await_channel(LaunchOf(), StoreOf({"test/channel": rewritten}), storage)  # type: ignore[arg-type]
    assert env[channel.ENV_DRIVER_ADDRESS] == "10.0.0.1:4242"
    assert env[channel.ENV_AUTHKEY] == channel.rank_credential(b"s" * 32, 1).hex()
