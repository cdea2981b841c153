"""The launch path: which executor a fit() gets, what each rank runs under torchrun, and the
channel between the driver and its ranks (JSON only, authenticated)."""

from __future__ import annotations

import json
import os
import socket
from multiprocessing import AuthenticationError
from pathlib import Path

import pytest
from test_channel_trust import pump
from test_scripts import SCRIPTS, torchrun

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep._internal.executors import choose_executor
from lockstep._internal.executors.channels import WorkerConnections
from lockstep._internal.executors.external import ExternalExecutor
from lockstep._internal.executors.local import LocalExecutor
from lockstep._internal.persist.storage import CheckpointEntry
from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS, RankEnv
from lockstep._internal.rank.step_timing import StepTimes
from lockstep._internal.wire import channel, codec, protocol
from lockstep.errors import WorkerFailure
from lockstep.torch import TorchTrainer

LAUNCHER_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


# -- choosing ------------------------------------------------------------------------------------


def test_a_plain_process_gets_the_local_executor() -> None:
    assert isinstance(choose_executor(ScalingConfig(num_workers=2), {}), LocalExecutor)


def test_a_launched_process_gets_the_external_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in LAUNCHER_ENV.items():
        monkeypatch.setenv(name, value)
    executor = choose_executor(ScalingConfig(num_workers=2), {})
    assert isinstance(executor, ExternalExecutor) and executor.launch_info.rank == 1
    assert isinstance(choose_executor(ScalingConfig(num_workers=2, executor="local"), {}), LocalExecutor)
    with pytest.raises(ValueError, match="num_workers must be 2"):
        choose_executor(ScalingConfig(num_workers=3), {})


def test_a_lockstep_worker_is_not_a_launched_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**LAUNCHER_ENV, ENV_DRIVER_ADDRESS: "127.0.0.1:1"}.items():
        monkeypatch.setenv(name, value)
    assert isinstance(choose_executor(ScalingConfig(num_workers=2), {}), LocalExecutor)


def test_ray_datasets_with_the_local_executor_are_refused() -> None:
    with pytest.raises(ValueError, match="Ray Datasets"):
        choose_executor(ScalingConfig(num_workers=2, executor="local"), {"train": object()})


def test_rank_env_round_trips_through_the_environment() -> None:
    rank = RankEnv(
        3,
        4,
        1,
        2,
        1,
        "10.0.0.1",
        1234,
        threads=2,
        visible_gpus=("0", "1"),
        gpu_ids=("1",),
        store_is_hosted=False,
        store_prefix="p/",
    )
    variables = rank.variables()
    assert variables["CUDA_VISIBLE_DEVICES"] == "0,1" and variables["GROUP_RANK"] == "1"
    assert RankEnv.from_environ(variables) == RankEnv(
        3, 4, 1, 2, 1, "10.0.0.1", 1234, threads=2, gpu_ids=("1",), store_is_hosted=False, store_prefix="p/"
    )


# -- under torchrun ------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_under_torchrun_each_rank_runs_the_function_its_own_process_built(tmp_path: Path) -> None:
    completed = torchrun("--max-restarts=0", str(SCRIPTS / "torchrun_own_globals.py"), str(tmp_path))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (line,) = [line for line in completed.stdout.splitlines() if line.startswith("SEEN ")]
    seen = json.loads(line[len("SEEN ") :])
    assert [entry["rank"] for entry in seen] == [0, 1]
    for entry in seen:
        assert entry["module_local_rank"] == entry["rank"] and entry["config_rank"] == entry["rank"]
        assert entry["module_pid"] == entry["pid"], "the train function saw another process's module globals"
        assert entry["file"] == f"opened_by_rank_{entry['rank']}.txt"
    assert seen[0]["pid"] != seen[1]["pid"]


# -- the channel ---------------------------------------------------------------------------------


def test_messages_travel_as_json_or_a_binary_report_and_come_back_equal() -> None:
    messages = [
        protocol.Hello(1, 42),
        protocol.Start(3, CheckpointEntry("checkpoint_000002", 2, {}, None), False, ["checkpoint_000002"]),
        protocol.Output(1, True, b"\x00\xffbytes"),
        protocol.Failed(WorkerFailure(1, "ValueError", "bad", "Traceback ...")),
        protocol.ReportDone(3, None),
    ]
    for message in messages:
        encoded = codec.encode(message)
        json.loads(encoded)
        assert codec.decode(encoded) == message
    reports = [
        protocol.Report(0, 3, '{"loss": 0.5}', "checkpoint_000003", "written"),
        protocol.Report(5, 2**40, None, step_times=StepTimes(0.5, 0.1, 0.2, 0.05)),
        protocol.Report(1, 0, "{}", "ünïcode", "external", "s3://bucket/ckpt"),
    ]
    for report in reports:
        encoded = codec.encode(report)
        assert encoded[0] == codec.REPORT_MARK and codec.decode(encoded) == report


def test_a_message_naming_any_other_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown message type"):
        codec.decode(json.dumps({"~type": "os.system", "command": "true"}).encode())
    with pytest.raises(ValueError, match="malformed Hello"):
        codec.decode(json.dumps({"~type": "Hello", "rank": 0, "shell": "true"}).encode())
    with pytest.raises(ValueError):
        codec.decode(b"\x80\x04pickled")


@pytest.mark.parametrize("cut", [1, 10, 20, -1])
def test_a_malformed_binary_report_is_refused(cut: int) -> None:
    encoded = codec.encode(protocol.Report(1, 7, None, "checkpoint_000007", "external", "/elsewhere"))
    with pytest.raises(ValueError, match="malformed Report"):
        codec.decode(encoded[:cut])
    with pytest.raises(ValueError, match="malformed Report"):
        codec.decode(encoded + b"x")
    with pytest.raises(ValueError, match="malformed Report"):
        codec.decode(encoded[:-1] + b"\xff")  # the last string is no longer UTF-8


def rogue_attempts(address: str) -> list[str]:
    """Connect to the driver with a wrong secret, then with garbage instead of the answer; say
    how each attempt ended."""
    outcomes = []
    try:
        channel.connect_to_driver(0, {ENV_DRIVER_ADDRESS: address, channel.ENV_AUTHKEY: "00" * 32})
        outcomes.append("wrong secret accepted")
    except (AuthenticationError, OSError, EOFError):  # ChannelRefused is an OSError
        outcomes.append("refused")
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        hello = codec.encode(protocol.Hello(1, os.getpid()))
        raw.sendall(len(hello).to_bytes(4, "big") + hello)
        challenge = raw.recv(1024)  # the driver's challenge (or b"" if rank 1 has connected already)
        reply = b""
        if challenge:
            raw.sendall(b"\x00\x00\x00\x04junk")
            reply = raw.recv(1024)
        outcomes.append("refused" if reply == b"" or b"#FAILURE#" in reply else f"answered {reply!r}")
    return outcomes


def rogue_train_func() -> None:
    outcomes = rogue_attempts(os.environ[ENV_DRIVER_ADDRESS]) if lockstep.get_context().get_world_rank() == 0 else []
    lockstep.report({"outcomes": outcomes})


@pytest.mark.timeout(120)
def test_the_driver_refuses_connections_without_the_secret_and_the_run_goes_on(storage_path: str) -> None:
    result = TorchTrainer(
        rogue_train_func,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, verbose=0),
    ).fit()
    assert result.metrics["outcomes"] == ["refused", "refused"]


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT_S", 0.2)
    connections = WorkerConnections("127.0.0.1", 2)
    try:
        with socket.create_connection(connections.listener.address) as silent:
            assert pump(connections, 1.0) == []
            silent.settimeout(5)
            assert silent.recv(1024) == b"", "the driver kept a silent peer past the handshake timeout"
        assert connections.connected_ranks() == set()
    finally:
        connections.close()
