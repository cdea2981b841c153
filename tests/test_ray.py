"""The Ray executor on a real Ray cluster of three raylets on this machine (a head with no CPUs
and two worker nodes, "0" and "1", with 2 CPUs each), shared by the tests of this module; plus
unit tests of its placement and rank logic, which need no cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, running_after, untagged
from test_channel_trust import assert_rogue_refused, rogue_config, rogue_peer_train_func
from test_launch import rogue_train_func
from validation_fns import validate_in_ray_task

import lockstep
from lockstep import (
    Checkpoint,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    ValidationConfig,
    ValidationTaskConfig,
)
from lockstep._internal.executors.ray import assign_ranks, rank_env
from lockstep._internal.executors.ray_placement import placement_problem, worker_bundle
from lockstep._internal.executors.ray_pool import POOL, release_kept_actors
from lockstep._internal.ray_compat.ray_actor import WorkerPlace
from lockstep._internal.run.worker_group import GroupSpec
from lockstep.torch import TorchTrainer

ray = pytest.importorskip("ray")
from ray import remote  # noqa: E402 - a Ray function under another name (test_a_train_function_that_names_ray...)
from ray.util import ActorPool  # noqa: E402

NODE_CPUS = 2
RESOURCE_RELEASE_WAIT_S = 30


# -- the cluster --------------------------------------------------------------------------------


WORKER_NODES = ("0", "1")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Three raylets; worker node ``n`` has LOCKSTEP_TEST_NODE=n in its environment
    (``cluster.test_nodes`` maps n to the node). The processes of the cluster don't carry the
    test tag (they outlive single tests by design); ``resources_released`` checks instead that
    every test gives back what it reserved, and ``cluster_restored`` that a test which removes or
    adds nodes leaves the cluster as it found it, so every test also runs alone or in any order."""
    from ray.cluster_utils import Cluster

    with untagged():
        test_cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        test_cluster.test_nodes = {}
        for label in WORKER_NODES:
            add_test_node(test_cluster, label)
        ray.init(address=test_cluster.address, log_to_driver=False)
        yield test_cluster
    finally:
        ray.shutdown()
        test_cluster.shutdown()


def add_test_node(cluster: Any, label: str) -> None:
    """Add a worker node of NODE_CPUS CPUs with LOCKSTEP_TEST_NODE=label; returns when it is alive."""
    with untagged():
        cluster.test_nodes[label] = cluster.add_node(num_cpus=NODE_CPUS, env_vars={"LOCKSTEP_TEST_NODE": label})


def remove_test_node(cluster: Any, label: str, lost: bool = False) -> None:
    """Take worker node ``label`` out of the cluster and return once the cluster sees it gone;
    ``lost``: kill it at once, as a machine is lost, and return without waiting."""
    cluster.remove_node(cluster.test_nodes.pop(label), allow_graceful=not lost)
    if not lost:
        cluster.wait_for_nodes()


@pytest.fixture
def cluster_restored(cluster: Any) -> Iterator[Any]:
    """The module's cluster, for a test that removes or adds nodes: afterwards worker nodes
    "0" and "1", and only they, are there again."""
    yield cluster
    for label in sorted(set(cluster.test_nodes) - set(WORKER_NODES)):
        remove_test_node(cluster, label)
    for label in sorted(set(WORKER_NODES) - set(cluster.test_nodes)):
        add_test_node(cluster, label)
    cluster.wait_for_nodes()


@pytest.fixture
def resources_released(cluster: Any) -> Iterator[None]:
    """After the test (and after the actors its fits kept for the next fit are released): every
    CPU is free again and no placement group is left."""
    yield
    release_kept_actors()
    deadline = time.monotonic() + RESOURCE_RELEASE_WAIT_S
    while time.monotonic() < deadline:
        total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
        groups = [group for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"]
        if free == total and not groups:
            return
        time.sleep(0.1)
    raise AssertionError(f"the test left resources held: {free} of {total} CPUs free, placement groups {groups}")


ray_test = pytest.mark.usefixtures("resources_released")


@pytest.fixture(params=["in actors", "forked"])
def rank_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test twice: ranks in their Ray actors, and forked by a warm process per node
    (``LOCKSTEP_RAY_FORK=1``)."""
    monkeypatch.setenv("LOCKSTEP_RAY_FORK", "1" if request.param == "forked" else "0")
    return str(request.param)


both_ways = pytest.mark.usefixtures("rank_processes")


# -- train functions ----------------------------------------------------------------------------


def report_placement() -> None:
    """Rank 0 reports every rank's view of itself."""
    import torch.distributed as dist

    context = lockstep.get_context()
    mine = {
        "rank": context.get_world_rank(),
        "local_rank": context.get_local_rank(),
        "local_world_size": context.get_local_world_size(),
        "node_rank": context.get_node_rank(),
        "node": os.environ["LOCKSTEP_TEST_NODE"],
        "ray_node": ray.get_runtime_context().get_node_id(),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    }
    everyone: list[Any] = [None] * context.get_world_size()
    dist.all_gather_object(everyone, mine)
    lockstep.report({"ranks": everyone})


def fit_on_ray(train_fn: Any, storage_path: str, **scaling: Any) -> lockstep.Result:
    run = RunConfig(
        storage_path=storage_path, failure_config=FailureConfig(max_failures=scaling.pop("max_failures", 0))
    )
    return TorchTrainer(train_fn, scaling_config=ScalingConfig(**scaling), run_config=run).fit()


@ray_test
@pytest.mark.timeout(120)
def test_spread_places_ranks_node_by_node(storage_path: str) -> None:
    result = fit_on_ray(report_placement, storage_path, num_workers=4, placement_strategy="SPREAD")
    ranks = result.metrics["ranks"]
    assert [entry["rank"] for entry in ranks] == [0, 1, 2, 3]
    assert {entry["node"] for entry in ranks} == {"0", "1"}
    for node_rank in (0, 1):
        on_node = [entry for entry in ranks if entry["node_rank"] == node_rank]
        assert len({entry["ray_node"] for entry in on_node}) == 1, "a node rank spans two Ray nodes"
        assert sorted(entry["local_rank"] for entry in on_node) == [0, 1]
        assert all(entry["local_world_size"] == 2 for entry in on_node)
    assert [entry["node_rank"] for entry in ranks] == [0, 0, 1, 1], "ranks are not grouped by node"
    assert len({entry["master"] for entry in ranks}) == 1


@ray_test
@pytest.mark.timeout(120)
def test_pack_keeps_ranks_on_one_node(storage_path: str) -> None:
    result = fit_on_ray(report_placement, storage_path, num_workers=2, placement_strategy="PACK")
    ranks = result.metrics["ranks"]
    assert len({entry["ray_node"] for entry in ranks}) == 1
    assert [(entry["local_rank"], entry["node_rank"], entry["local_world_size"]) for entry in ranks] == [
        (0, 0, 2),
        (1, 0, 2),
    ]


def fail_on_rank_1() -> None:
    if lockstep.get_context().get_world_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    lockstep.report({"never": True})


@ray_test
@both_ways
@pytest.mark.timeout(120)
def test_a_failing_rank_is_named_with_its_traceback(storage_path: str) -> None:
    with pytest.raises(TrainingFailedError) as failure:
        fit_on_ray(fail_on_rank_1, storage_path, num_workers=2, placement_strategy="SPREAD")
    message = str(failure.value)
    assert "rank 1" in message and "ValueError: rank 1 fails on purpose" in message
    assert f'File "{__file__}"' in message and "in fail_on_rank_1" in message
    assert "rank 0 was still running, here:" in message


@ray_test
@both_ways
@pytest.mark.timeout(120)
def test_a_hung_rank_is_named_with_where_every_rank_is(storage_path: str, tmp_path: Path) -> None:
    from test_hangs import train_steps

    trainer = TorchTrainer(
        train_steps,
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
        train_loop_config={"steps": 10_000, "stuck_rank": 1, "stuck_at": 20, "marker": str(tmp_path / "stuck_since")},
        run_config=RunConfig(storage_path=storage_path, failure_config=FailureConfig(hang_timeout_s=2)),
    )
    with pytest.raises(lockstep.WorkerGroupError) as failure:
        trainer.fit()
    named_after_s = time.time() - float((tmp_path / "stuck_since").read_text())
    assert list(failure.value.failures) == [1] and failure.value.failures[1].error_type == "Hang"
    message = str(failure.value)
    assert "this rank is in no collective while rank 0 waits in gloo:all_reduce #" in message
    stack_of_0 = message.split("rank 0 was still running, here:\n")[1].split("\n\nrank 1 was")[0]
    stack_of_1 = message.split("rank 1 was still running, here:\n")[1]
    assert stack_of_0.startswith("(waiting in torch collective gloo:all_reduce #") and "in backward" in stack_of_0
    assert "in train_steps" in stack_of_1 and "threading.Event().wait()" in stack_of_1
    # 2 s without progress, up to 3 s for the ranks to say where they are, up to 5 s for the actors'
    # stacks, and the time to stop the actors
    assert named_after_s < 2 + 3 + 5 + 5, f"named {named_after_s:.1f} s after rank 1 stopped"


@ray_test
@pytest.mark.timeout(120)
def test_the_driver_refuses_connections_without_the_secret(storage_path: str) -> None:
    result = fit_on_ray(rogue_train_func, storage_path, num_workers=2, placement_strategy="SPREAD")
    assert result.metrics["outcomes"] == ["refused", "refused"]


@ray_test
@pytest.mark.timeout(120)
def test_a_rogue_peer_with_an_actors_credential_runs_nothing(tmp_path: Path, storage_path: str) -> None:
    config = rogue_config(tmp_path)
    trainer = TorchTrainer(
        rogue_peer_train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
        run_config=RunConfig(storage_path=storage_path),
    )
    result = trainer.fit()
    assert_rogue_refused(config["out"], config["marker"])
    assert result.return_value == "rank 0's own value" and result.metrics["broadcast"] == "rank 0"


@ray_test
@pytest.mark.timeout(60)
def test_a_request_the_cluster_can_never_hold_fails_at_once(storage_path: str) -> None:
    started = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"(?s)can't hold 2 worker\(s\) .*no node holds more than 1.*node [0-9.]+ \([0-9a-f]{8}\): CPU=2, memory=",
    ):
        fit_on_ray(
            report_placement,
            storage_path,
            num_workers=2,
            resources_per_worker={"CPU": 2},
            placement_strategy="STRICT_PACK",
        )
    with pytest.raises(ValueError, match="STRICT_SPREAD needs 3 nodes"):
        fit_on_ray(report_placement, storage_path, num_workers=3, placement_strategy="STRICT_SPREAD")
    with pytest.raises(ValueError, match=r"'TPU': 1\.0"):
        fit_on_ray(report_placement, storage_path, num_workers=1, resources_per_worker={"CPU": 1, "TPU": 1})
    assert time.monotonic() - started < 10


@ray_test
@pytest.mark.timeout(60)
def test_resources_held_by_others_fail_after_the_placement_timeout(storage_path: str) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    holder = placement_group([{"CPU": NODE_CPUS}, {"CPU": NODE_CPUS}], strategy="STRICT_SPREAD")
    assert holder.wait(timeout_seconds=30)
    try:
        started = time.monotonic()
        with pytest.raises(
            TrainingFailedError, match=r"(?s)within 2 s \(ScalingConfig.placement_timeout_s\).*Available now"
        ):
            fit_on_ray(report_placement, storage_path, num_workers=2, placement_timeout_s=2)
        assert 2 <= time.monotonic() - started < 20
    finally:
        remove_placement_group(holder)


def read_ray_shards() -> None:
    import torch
    import torch.distributed as dist

    shard = lockstep.get_dataset_shard("train")
    ids = [int(value) for batch in shard.iter_batches(batch_size=16) for value in batch["id"]]
    tensors = list(shard.iter_torch_batches(batch_size=16))
    everyone: list[Any] = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(everyone, ids)
    torch_shard = [int(item) for item in lockstep.get_dataset_shard("numbers")]
    lockstep.report(
        {
            "ids": everyone,
            "tensor_batches": all(isinstance(batch["id"], torch.Tensor) for batch in tensors),
            "numbers": torch_shard,
        }
    )


@ray_test
@pytest.mark.timeout(120)
def test_ray_datasets_get_streaming_splits_and_torch_datasets_shards(storage_path: str) -> None:
    dataset = ray.data.range(100)
    trainer = TorchTrainer(
        read_ray_shards,
        datasets={"train": dataset, "numbers": list(range(10, 20))},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path),
    )
    metrics = trainer.fit().metrics
    first, second = metrics["ids"]
    assert len(first) == len(second) == 50
    assert sorted(first + second) == list(range(100))
    assert metrics["tensor_batches"]
    assert metrics["numbers"] == list(range(10, 15)), "a map-style dataset is not sharded as on one machine"


def print_from_every_rank() -> None:
    rank = lockstep.get_context().get_world_rank()
    print(f"print from rank {rank}")
    os.write(2, f"fd 2 of rank {rank}\n".encode())
    lockstep.report({"rank": rank})


@ray_test
@both_ways
@pytest.mark.timeout(120)
def test_worker_output_reaches_the_console_and_per_rank_logs(
    storage_path: str, capfd: pytest.CaptureFixture[str]
) -> None:
    run = RunConfig(name="printing", storage_path=storage_path)
    TorchTrainer(print_from_every_rank, scaling_config=ScalingConfig(num_workers=2), run_config=run).fit()
    console = capfd.readouterr()
    assert "print from rank 0" in console.out and "fd 2 of rank 0" in console.err
    assert "rank 1" not in console.out + console.err
    logs = Path(storage_path, "printing", "logs")
    assert "print from rank 1" in (logs / "rank_1.log").read_text()
    assert "fd 2 of rank 1" in (logs / "rank_1.log").read_text()


def checkpoint_once() -> None:
    with tempfile.TemporaryDirectory() as folder:
        lockstep.report({"step": 0}, checkpoint=Checkpoint.from_directory(folder))


@ray_test
@pytest.mark.timeout(120)
def test_storage_a_node_cannot_see_is_named(tmp_path: Path) -> None:
    from node_local_fs import NodeLocalFileSystem

    trainer = TorchTrainer(
        checkpoint_once,
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(
            name="unshared", storage_path="runs", storage_filesystem=NodeLocalFileSystem(str(tmp_path))
        ),
    )
    with pytest.raises(TrainingFailedError, match=r"rank \d can't see the run folder .* must be shared by every node"):
        trainer.fit()


@ray_test
@pytest.mark.timeout(200)
def test_seed_003_script_with_ray_init_trains_on_the_cluster(cluster: Any, tmp_path: Path, data_dir: Path) -> None:
    script = REPO_ROOT / "tests" / "scripts" / "seed_003_lockstep.py"
    completed = subprocess.run(
        [sys.executable, str(script), "--num-workers", "2", "--address", cluster.address],
        capture_output=True,
        text=True,
        timeout=190,
        cwd=REPO_ROOT,
        env={**os.environ, "LOCKSTEP_DATA": str(data_dir), "HOME": str(tmp_path)},
    )
    assert completed.returncode == 0, f"{completed.stdout}\n{completed.stderr}"
    assert "Last result: {'loss': " in completed.stdout
    (run,) = (tmp_path / "lockstep_results").iterdir()
    record = json.loads((run / "lockstep_run.json").read_text())
    assert record["executor"] == "ray" and record["status"] == "finished"


# -- checkpoint validation: Ray tasks, and Ray Train itself on the same script -----------------------


def report_three_to_validate() -> None:
    """Three checkpoints: validated, failing, running past its timeout."""
    modes = [True, ValidationTaskConfig({"mode": "fail"}), ValidationTaskConfig({"mode": "hang"}, timeout_s=2)]
    for step, validation in enumerate(modes):
        with tempfile.TemporaryDirectory() as folder:
            if lockstep.get_context().get_world_rank() == 0:
                Path(folder, "value.txt").write_text(str(step + 1))
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder), validation=validation)


@ray_test
@pytest.mark.timeout(180)
def test_validations_run_as_ray_tasks_with_the_ray_remote_kwargs(storage_path: str) -> None:
    result = TorchTrainer(
        report_three_to_validate,
        scaling_config=ScalingConfig(num_workers=2, executor="ray"),
        run_config=RunConfig(storage_path=storage_path),
        validation_config=ValidationConfig(validate_in_ray_task, ray_remote_kwargs={"num_cpus": 1, "max_retries": 0}),
    ).fit()
    record = json.loads(Path(result.path, "lockstep_run.json").read_text())
    assert record["executor"] == "ray"
    first, failed, timed_out = record["checkpoints"]
    assert first["validation"] == "VALIDATED"
    assert first["metrics"]["val"] == 1.0 and first["metrics"]["in_task"] is True
    assert first["metrics"]["node"] in WORKER_NODES
    assert (failed["validation"], timed_out["validation"]) == ("VALIDATION_FAILED", "VALIDATION_TIMEOUT")


def run_same_script(framework: str, storage: Path, address: str | None) -> dict[str, Any]:
    command = [
        sys.executable,
        str(REPO_ROOT / "tests" / "scripts" / "validation_same_script.py"),
        "--framework",
        framework,
        "--storage",
        str(storage),
    ]
    completed = subprocess.run(
        command + (["--address", address] if address else []),
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, f"{framework}:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    return json.loads(completed.stdout.strip().splitlines()[-1])


@ray_test
@pytest.mark.timeout(400)
def test_validation_as_ray_train_does_it_on_the_same_script(cluster: Any, tmp_path: Path) -> None:
    """The same script under Ray Train 2.60 (on this cluster) and under lockstep (its imports
    swapped; the local executor): the same statuses and validation metrics, the same Result,
    except the documented retention difference: with num_to_keep=2 by the validation metric,
    Ray keeps the latest two (the best, step 1, was deleted before its validation ended), and
    lists the unscored timed-out one among the best; lockstep keeps the best two validated (1
    and 3) and the latest (4)."""
    ray_sees = run_same_script("ray", tmp_path / "ray", cluster.address)
    ours = run_same_script("lockstep", tmp_path / "lockstep", None)

    by_step = {item["step"]: item for item in ours["in_train_func"]}
    assert ray_sees["in_train_func"], "Ray kept checkpoints"
    for theirs in ray_sees["in_train_func"]:
        assert by_step[theirs["step"]] == theirs, f"step {theirs['step']}: Ray {theirs}, lockstep {by_step}"
    assert {item["status"] for item in ours["in_train_func"]} == {"VALIDATED", "VALIDATION_TIMEOUT"}
    assert ours["result_metrics"] == ray_sees["result_metrics"]
    assert ours["latest_value"] == ray_sees["latest_value"]
    # the documented difference
    assert sorted(item["step"] for item in ray_sees["in_train_func"]) == [3, 4]
    assert sorted(by_step) == [1, 3, 4]
    assert [metrics["step"] for metrics in ray_sees["best"]] == [3, 4]
    assert [metrics["step"] for metrics in ours["best"]] == [3, 1]
    assert ours["best"][0] == ray_sees["best"][0], "the validated checkpoint both keep reads the same"


def fit_in_background(trainer: TorchTrainer) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``trainer.fit()`` on a thread; its result or error lands in the returned dict."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = error

    driver = threading.Thread(target=fit)
    driver.start()
    return driver, outcome


def wait_while_running(path: Path, driver: threading.Thread, outcome: dict[str, Any], timeout_s: float = 150) -> None:
    """Wait until the train function writes ``path``, failing if the run ends or takes too long."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert driver.is_alive() and time.monotonic() < deadline, f"the run never wrote {path.name}: {outcome}"
        time.sleep(0.05)


def train_until_a_node_is_lost(config: dict[str, Any]) -> None:
    """Report a checkpoint per step; in the first attempt, stop after step 1 and wait (to be
    killed with the node)."""
    context = lockstep.get_context()
    start = lockstep.get_checkpoint()
    first_step = int(Path(start.path, "step").read_text()) + 1 if start else 0
    for step in range(first_step, 4):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step").write_text(str(step))
            lockstep.report(
                {"step": step, "node": os.environ["LOCKSTEP_TEST_NODE"], "rank": context.get_world_rank()},
                checkpoint=Checkpoint.from_directory(folder),
            )
        if start is None and step == 1:
            Path(config["reached"]).write_text("step 1")
            threading.Event().wait()


@ray_test
@pytest.mark.timeout(240)
def test_losing_a_node_restarts_from_the_latest_checkpoint_on_the_rest(
    cluster_restored: Any, storage_path: str, tmp_path: Path
) -> None:
    reached = tmp_path / "reached"
    driver, outcome = fit_in_background(
        TorchTrainer(
            train_until_a_node_is_lost,
            train_loop_config={"reached": str(reached)},
            scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD"),
            run_config=RunConfig(storage_path=storage_path, failure_config=FailureConfig(max_failures=1)),
        )
    )
    wait_while_running(reached, driver, outcome)
    remove_test_node(cluster_restored, "1", lost=True)
    driver.join(180)
    assert not driver.is_alive()
    result = outcome.get("result")
    assert result is not None, outcome.get("error")
    assert result.num_failures == 1
    assert result.metrics["step"] == 3 and result.metrics["node"] == "0"
    steps = [row["step"] for row in result.metrics_history]
    assert steps == [0, 1, 2, 3]
    assert Path(result.checkpoint.path, "step").read_text() == "3"


def grow_when_told(config: dict[str, Any]) -> None:
    """Steps 0-4, a checkpoint each; with 1 worker, waits after step 1 for a node to be added."""
    world = lockstep.get_context().get_world_size()
    start = lockstep.get_checkpoint()
    step = int(Path(start.path, "step").read_text()) + 1 if start else 0
    nodes: list[Any] = [None] * world
    import torch.distributed as dist

    dist.all_gather_object(nodes, os.environ["LOCKSTEP_TEST_NODE"])
    while step < 5:
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step").write_text(str(step))
            lockstep.report(
                {"step": step, "world": world, "nodes": nodes}, checkpoint=Checkpoint.from_directory(folder)
            )
        if world == 1 and step == 1:
            Path(config["small"]).write_text("")
            deadline = time.monotonic() + 120
            while not Path(config["grow"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        step += 1


@ray_test
@pytest.mark.timeout(240)
def test_an_elastic_run_starts_with_what_fits_and_grows_when_a_node_joins(
    cluster_restored: Any, storage_path: str, tmp_path: Path
) -> None:
    remove_test_node(cluster_restored, "1")  # one 2-CPU worker node is left: 1 worker of 2 CPUs fits
    marks = {"small": str(tmp_path / "small"), "grow": str(tmp_path / "grow")}
    driver, outcome = fit_in_background(
        TorchTrainer(
            grow_when_told,
            train_loop_config=marks,
            scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": NODE_CPUS}),
            run_config=RunConfig(storage_path=storage_path),
        )
    )
    wait_while_running(Path(marks["small"]), driver, outcome)
    add_test_node(cluster_restored, "1")
    Path(marks["grow"]).write_text("")
    driver.join(180)
    result = outcome.get("result")
    assert result is not None, outcome.get("error")
    assert [(row["step"], row["world"]) for row in result.metrics_history] == [(0, 1), (1, 1), (2, 1), (3, 2), (4, 2)]
    assert sorted(result.metrics["nodes"]) == ["0", "1"]
    assert result.num_failures == 0


# -- node drains (preemption notices) ------------------------------------------------------------


def train_until_preempted(config: dict[str, Any]) -> None:
    """A step every 0.2 s, reported with what get_preemption_info() returns; a checkpoint at steps
    2 and 5, at the last step, and right after a preemption notice is seen (so that some report
    sees the notice before the run stops at a checkpoint); rank 1 writes where it runs and its
    last step to config["progress"]."""
    context = lockstep.get_context()
    start = lockstep.get_checkpoint()
    first = int(Path(start.path, "step").read_text()) + 1 if start else 0
    progress = Path(config["progress"])
    for step in range(first, config["steps"]):
        time.sleep(0.2)
        info = lockstep.get_preemption_info()
        metrics = {
            "step": step,
            "first": first,
            "preempted": info and info.preempted_node_to_ranks,
            "deadline_ms": info and info.deadline_ms,
        }
        if step in (2, 5, config["steps"] - 1) or info is not None:
            with tempfile.TemporaryDirectory() as folder:
                Path(folder, "step").write_text(str(step))
                lockstep.report(metrics, checkpoint=Checkpoint.from_directory(folder))
        else:
            lockstep.report(metrics)
        if context.get_world_rank() == 1:
            where = {
                "step": step,
                "label": os.environ["LOCKSTEP_TEST_NODE"],
                "node_id": ray.get_runtime_context().get_node_id(),
            }
            progress.with_suffix(".tmp").write_text(json.dumps(where))
            progress.with_suffix(".tmp").replace(progress)


def drain(cluster: Any, node_id: str, deadline_s: int = 60) -> None:
    """Ask Ray to drain a node as a preemption does (what ``ray drain-node`` asks)."""
    from ray.core.generated import autoscaler_pb2

    accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "the test preempts it",
        int(time.time() * 1000) + deadline_s * 1000,
    )
    assert accepted, why


def replace_drained_node(cluster: Any, label: str) -> None:
    """A drained node leaves once nothing runs there: wait for that (30 s at most), take it out and
    add a fresh node of that label (the preempted machine is replaced)."""
    node_id = cluster.test_nodes[label].node_id
    deadline = time.monotonic() + 30
    while any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    remove_test_node(cluster, label, lost=True)
    add_test_node(cluster, label)


def rank_1_progress(path: Path, after_step: int, driver: threading.Thread, outcome: dict[str, Any]) -> dict[str, Any]:
    """Wait until rank 1 has reported a step after ``after_step``; where it runs."""
    deadline = time.monotonic() + 120
    while True:
        where = json.loads(path.read_text()) if path.exists() else {"step": -1}
        if where["step"] > after_step:
            return where
        assert driver.is_alive() and time.monotonic() < deadline, f"rank 1 did not go past step {after_step}: {outcome}"
        time.sleep(0.05)


@ray_test
@pytest.mark.timeout(240)
def test_a_drained_node_is_a_preemption_notice_for_its_ranks(
    cluster_restored: Any, storage_path: str, tmp_path: Path
) -> None:
    cluster = cluster_restored
    with untagged():  # a node the group can't use (1 CPU), kept busy so that it stays draining
        cluster.test_nodes["2"] = cluster.add_node(num_cpus=1, env_vars={"LOCKSTEP_TEST_NODE": "2"})
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    holder = (
        ray.remote(num_cpus=1)(threading.Event)
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.test_nodes["2"].node_id, soft=False))
        .remote()
    )
    ray.get(holder.is_set.remote())
    progress = tmp_path / "progress.json"

    def trainer(steps: int) -> TorchTrainer:
        return TorchTrainer(
            train_until_preempted,
            train_loop_config={"steps": steps, "progress": str(progress)},
            scaling_config=ScalingConfig(
                num_workers=2, placement_strategy="SPREAD", resources_per_worker={"CPU": NODE_CPUS}
            ),
            run_config=RunConfig(
                name="drained", storage_path=storage_path, failure_config=FailureConfig(preemption_grace_s=60)
            ),
        )

    driver, outcome = fit_in_background(trainer(steps=500))
    drained_label = None
    try:
        where = rank_1_progress(progress, 5, driver, outcome)  # past the regular checkpoints
        drain(cluster, cluster.test_nodes["2"].node_id)  # a node without ranks of the group: nothing happens
        assert cluster.test_nodes["2"].node_id in ray._private.state.state.get_draining_nodes()
        before = rank_1_progress(progress, where["step"] + 10, driver, outcome)["step"]  # 2 s at least: 2 polls
        drained_label = where["label"]
        drain(cluster, where["node_id"])
        driver.join(120)
        assert not driver.is_alive()
    finally:
        ray.kill(holder)
        if drained_label is not None:
            driver.join(120)
            replace_drained_node(cluster, drained_label)
    error = outcome.get("error")
    assert isinstance(error, lockstep.PreemptionError), outcome
    assert error.preemption_info.preempted_ranks == [1] and not error.drain_timed_out
    assert POOL.kept is None, "a preempted fit keeps no actors"

    run = Path(storage_path, "drained")
    record = json.loads((run / "lockstep_run.json").read_text())
    assert record["status"] == "preempted" and record.get("num_failures", 0) == 0
    rows = [json.loads(line)["metrics"] for line in (run / "reports.jsonl").read_text().splitlines()]
    assert all(row["preempted"] is None for row in rows if row["step"] <= before), "an unused node's drain was a notice"
    noticed = [row for row in rows if row["preempted"]]
    assert noticed, "the ranks never saw the notice in report()"
    assert list(noticed[0]["preempted"].values()) == [[1]], noticed[0]
    assert noticed[0]["deadline_ms"] > time.time() * 1000
    stopped_at = int((run / record["latest_checkpoint"] / "step").read_text())
    assert stopped_at == rows[-1]["step"] == noticed[0]["step"], "it stopped at the checkpoint made on the notice"

    result = trainer(steps=stopped_at + 4).fit()
    assert result.num_failures == 0
    assert [row["step"] for row in result.metrics_history][-3:] == [stopped_at + 1, stopped_at + 2, stopped_at + 3]
    assert result.metrics["first"] == stopped_at + 1
    assert Path(result.checkpoint.path, "step").read_text() == str(stopped_at + 3)


# -- actors kept between fits -------------------------------------------------------------------

#: Module globals of an imported module persist in a kept actor (as documented); the tests
#: below use this one to hand the first fit's process group to the second.
_left_by_earlier_fit: dict[str, Any] = {}


def report_pids() -> None:
    """Rank 0 reports every rank's pid."""
    import torch.distributed as dist

    pids: list[Any] = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(pids, os.getpid())
    lockstep.report({"pids": pids})


def leave_leftovers() -> None:
    """Report what an earlier fit in this process left (a variable, a process group), then leave
    the same for the next."""
    import torch.distributed as dist

    seen = {
        "pid": os.getpid(),
        "variable": os.environ.get("LOCKSTEP_TEST_LEFTOVER"),
        "had_earlier_group": "group" in _left_by_earlier_fit,
        "earlier_group_gone": None,
    }
    if "group" in _left_by_earlier_fit:
        try:
            dist.get_rank(_left_by_earlier_fit["group"])
            seen["earlier_group_gone"] = False
        except ValueError:
            seen["earlier_group_gone"] = True
        seen["same_world"] = _left_by_earlier_fit["world"] is dist.group.WORLD
    _left_by_earlier_fit.update(group=dist.new_group([0, 1]), world=dist.group.WORLD)
    os.environ["LOCKSTEP_TEST_LEFTOVER"] = "set by an earlier fit"
    everyone: list[Any] = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(everyone, seen)
    lockstep.report({"ranks": everyone})


def fail_after_telling_pids(config: dict[str, Any]) -> None:
    import torch.distributed as dist

    Path(config["folder"], f"pid_{os.getpid()}").write_text("")
    dist.barrier()  # both pids written before rank 1 fails (the failure kills rank 0 at once)
    if lockstep.get_context().get_world_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    lockstep.report({"never": True})


@ray_test
@pytest.mark.timeout(150)
def test_a_second_fit_reuses_the_actors_of_a_clean_one_without_its_leftovers(
    storage_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKSTEP_RAY_FORK", "0")  # the ranks run in the actors' own processes
    first = fit_on_ray(leave_leftovers, storage_path, num_workers=2).metrics["ranks"]
    assert POOL.kept is not None and len(POOL.kept.actors) == 2
    second = fit_on_ray(leave_leftovers, storage_path, num_workers=2).metrics["ranks"]
    assert [rank["pid"] for rank in second] == [rank["pid"] for rank in first], "the actors were not reused"
    for rank in second:
        assert rank["had_earlier_group"], "not the same process: the module global is gone"
        assert rank["variable"] is None, "the first fit's environment variable leaked into the second"
        assert rank["earlier_group_gone"] is True and rank["same_world"] is False, (
            "the first fit's process group survived"
        )
    release_kept_actors()
    assert POOL.kept is None
    assert not running_after({rank["pid"] for rank in second}, 20), "released actors still run"


@ray_test
@pytest.mark.timeout(150)
def test_a_failed_fits_actors_are_not_reused(storage_path: str, tmp_path: Path) -> None:
    trainer = TorchTrainer(
        fail_after_telling_pids,
        train_loop_config={"folder": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path),
    )
    with pytest.raises(TrainingFailedError, match="rank 1 fails on purpose"):
        trainer.fit()
    assert POOL.kept is None
    failed = {int(path.name.split("_")[1]) for path in tmp_path.glob("pid_*")}
    assert len(failed) == 2
    pids = set(fit_on_ray(report_pids, storage_path, num_workers=2).metrics["pids"])
    assert not pids & failed
    assert not running_after(failed, 20), "the failed fit's actors still run"


def report_pids_until_stopped() -> None:
    """Report every rank's pid at each step, until the run is stopped."""
    import torch.distributed as dist

    pids: list[Any] = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(pids, os.getpid())
    for step in range(1000):
        lockstep.report({"step": step, "pids": pids})


@ray_test
@pytest.mark.timeout(150)
def test_the_actors_of_a_run_stopped_early_are_reused(storage_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_RAY_FORK", "0")  # the ranks run in the actors' own processes
    run = RunConfig(storage_path=storage_path, stop={"training_iteration": 2})
    stopped = TorchTrainer(report_pids_until_stopped, scaling_config=ScalingConfig(num_workers=2), run_config=run).fit()
    assert stopped.metrics["step"] == 1
    assert fit_on_ray(report_pids, storage_path, num_workers=2).metrics["pids"] == stopped.metrics["pids"]


@ray_test
@pytest.mark.timeout(150)
def test_another_shape_gets_new_actors_and_the_kept_ones_are_released(storage_path: str) -> None:
    packed = set(fit_on_ray(report_pids, storage_path, num_workers=2, placement_strategy="PACK").metrics["pids"])
    spread = set(fit_on_ray(report_pids, storage_path, num_workers=2, placement_strategy="SPREAD").metrics["pids"])
    assert not packed & spread
    assert not running_after(packed, 20), "the kept actors of the other shape still run"
    assert POOL.kept is not None and POOL.kept.shape.placement_strategy == "SPREAD"


@ray_test
@pytest.mark.timeout(150)
def test_warm_start_off_starts_new_actors_for_every_fit(storage_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_WARM_START", "0")
    first = set(fit_on_ray(report_pids, storage_path, num_workers=2).metrics["pids"])
    assert POOL.kept is None
    second = set(fit_on_ray(report_pids, storage_path, num_workers=2).metrics["pids"])
    assert not first & second


def report_process_tree() -> None:
    """Rank 0 reports every rank's pid, node and parent process."""
    import torch.distributed as dist

    parent = os.getppid()
    mine = {
        "pid": os.getpid(),
        "node": os.environ["LOCKSTEP_TEST_NODE"],
        "parent": parent,
        "parent_command": Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode(),
    }
    everyone: list[Any] = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(everyone, mine)
    lockstep.report({"ranks": everyone})


@ray_test
@pytest.mark.timeout(150)
def test_forked_ranks_are_children_of_one_warm_process_per_node(storage_path: str) -> None:
    first = fit_on_ray(report_process_tree, storage_path, num_workers=4, placement_strategy="SPREAD").metrics["ranks"]
    parents = {rank["node"]: rank["parent"] for rank in first}
    assert sorted(parents) == ["0", "1"]
    for rank in first:
        assert rank["parent"] == parents[rank["node"]], f"two warm processes on node {rank['node']}"
        assert "-m lockstep._internal.warm.zygote " in rank["parent_command"]
    assert POOL.kept is not None and len(POOL.kept.actors) == 4
    second = fit_on_ray(report_process_tree, storage_path, num_workers=4, placement_strategy="SPREAD").metrics["ranks"]
    assert {rank["parent"] for rank in second} == set(parents.values()), (
        "the kept actors' warm processes were not reused"
    )
    assert not {rank["pid"] for rank in first} & {rank["pid"] for rank in second}, "a rank process outlived its fit"
    release_kept_actors()
    everything = {rank["pid"] for rank in first + second} | set(parents.values())
    assert not running_after(everything, 20), "released actors left their warm processes or ranks running"


@ray_test
@pytest.mark.timeout(120)
def test_ranks_given_ray_datasets_run_in_their_actors(storage_path: str) -> None:
    trainer = TorchTrainer(
        report_process_tree,
        scaling_config=ScalingConfig(num_workers=2),
        datasets={"train": ray.data.range(8)},
        run_config=RunConfig(storage_path=storage_path),
    )
    ranks = trainer.fit().metrics["ranks"]
    assert not any("lockstep._internal.warm.zygote" in rank["parent_command"] for rank in ranks)


# -- without a cluster --------------------------------------------------------------------------


def calls_ray_inside() -> None:
    import ray as imported_here

    imported_here.get_runtime_context()


def asks_a_helper() -> None:
    lockstep.report({"node": node_of_this_rank()})


def node_of_this_rank() -> str:
    return ray.get_runtime_context().get_node_id()


def test_a_train_function_that_names_ray_keeps_its_ranks_in_their_actors() -> None:
    from lockstep._internal.executors.ray_forking import names_ray

    assert names_ray(print_from_every_rank, {"steps": 3}) is None
    assert names_ray(report_process_tree, None) is None  # lockstep's and torch's names: forked
    assert "report_placement names 'ray'" in str(names_ray(report_placement, None))
    assert "calls_ray_inside names 'ray'" in str(names_ray(calls_ray_inside, None))
    assert "node_of_this_rank names 'ray'" in str(names_ray(asks_a_helper, None))  # a helper it calls
    assert "names 'remote'" in str(names_ray(lambda: remote(), None))  # a name bound to Ray's function
    assert "train_loop_config['pool']" in str(names_ray(print_from_every_rank, {"pool": [ActorPool]}))


def place(node: str, *gpus: str) -> WorkerPlace:
    return WorkerPlace(node_id=node, node_ip=f"10.0.0.{ord(node[0]) % 10}", gpu_ids=tuple(gpus), pid=0)


def test_ranks_are_grouped_by_node_driver_node_first_then_by_gpu() -> None:
    places = [place("b", "1"), place("a", "3"), place("b", "0"), place("a", "2")]
    ranks = assign_ranks(places, first_node_id="a")
    assert [(rank.actor_index, rank.node_rank, rank.local_rank) for rank in ranks] == [
        (3, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (0, 1, 1),
    ]
    env = rank_env(ranks, ranks[2], 29500, cpus=2, use_gpu=True).variables()
    assert env["RANK"] == "2" and env["LOCAL_RANK"] == "0" and env["NODE_RANK"] == "1"
    assert env["MASTER_ADDR"] == places[3].node_ip and env["MASTER_PORT"] == "29500"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["LOCKSTEP_GPU_IDS"] == "0"
    assert env["OMP_NUM_THREADS"] == "2"


def test_gpu_ids_sort_as_numbers() -> None:
    ranks = assign_ranks([place("a", "10"), place("a", "9")])
    assert [rank.actor_index for rank in ranks] == [1, 0]


@pytest.mark.parametrize(
    "strategy, count, nodes, problem",
    [
        ("PACK", 4, [{"CPU": 2}, {"CPU": 2}], None),
        ("PACK", 5, [{"CPU": 2}, {"CPU": 2}], "hold at most 4"),
        ("STRICT_PACK", 3, [{"CPU": 2}, {"CPU": 2}], "no node holds more than 2"),
        ("STRICT_PACK", 2, [{"CPU": 1}, {"CPU": 2}], None),
        ("STRICT_SPREAD", 2, [{"CPU": 4}, {"CPU": 0}], "2 nodes that each hold a worker, and 1 do"),
        ("SPREAD", 1, [{"CPU": 8}], None),
    ],
)
def test_placement_problem(strategy: str, count: int, nodes: list[dict[str, float]], problem: str | None) -> None:
    found = placement_problem({"CPU": 1}, count, strategy, nodes)
    assert (found is None) if problem is None else (problem in (found or "")), found


def test_bundle_carries_gpus_custom_resources_and_accelerator_type() -> None:
    spec = GroupSpec(
        num_workers=1,
        cpus_per_worker=2,
        gpus_per_worker=1,
        use_gpu=True,
        resources_per_worker={"CPU": 2, "GPU": 1, "special": 1},
        accelerator_type="A100",
    )
    assert worker_bundle(spec) == {"CPU": 2.0, "GPU": 1.0, "special": 1.0, "accelerator_type:A100": 0.001}
    assert placement_problem(worker_bundle(spec), 1, "PACK", [{"CPU": 8, "GPU": 8, "special": 1}]) is not None


def test_asking_for_ray_without_ray_installed_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, storage_path: str
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"pip install 'lockstep\[ray\]'"):
        TorchTrainer(
            report_placement,
            scaling_config=ScalingConfig(executor="ray"),
            run_config=RunConfig(storage_path=storage_path),
        ).fit()


def test_ray_executor_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="executor='cloud' is unknown"):
        ScalingConfig(executor="cloud")
    with pytest.raises(ValueError, match="placement_timeout_s"):
        ScalingConfig(placement_timeout_s=0)
    with pytest.raises(ValueError, match="ray_address is set but executor='local'"):
        ScalingConfig(executor="local", ray_address="auto")
    assert ScalingConfig(ray_address="auto").wants_ray


# -- found in review: placement on autoscaling clusters, Ctrl-C while placing, Ray's error text --


def test_an_autoscaling_cluster_is_judged_by_the_most_its_config_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep._internal.executors import ray_placement

    spec = GroupSpec(
        num_workers=2, cpus_per_worker=0, gpus_per_worker=1, use_gpu=True, resources_per_worker={"GPU": 1.0}
    )
    monkeypatch.setattr(ray_placement, "alive_nodes", lambda: {"head": {"CPU": 2.0}})  # no GPU node up yet
    monkeypatch.setattr(ray_placement, "autoscaler_max_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    ray_placement.check_request(spec)  # the autoscaler adds the GPU nodes: no refusal
    monkeypatch.setattr(ray_placement, "autoscaler_max_resources", lambda: {"CPU": 64.0, "GPU": 1.0})
    with pytest.raises(ValueError, match="they need GPU=2, and its autoscaler config allows at most GPU=1"):
        ray_placement.check_request(spec)
    monkeypatch.setattr(ray_placement, "autoscaler_max_resources", lambda: None)
    with pytest.raises(ValueError, match="can't hold 2 worker"):  # a fixed cluster: its nodes as they are
        ray_placement.check_request(spec)


def test_ctrl_c_while_waiting_for_placement_removes_the_placement_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from lockstep._internal.executors import ray_placement

    placement = importlib.import_module("ray.util.placement_group")  # the module (ray.util's attribute: a function)

    class Waiting:
        waits = 0

        def wait(self, timeout_seconds: float) -> bool:
            Waiting.waits += 1
            assert timeout_seconds <= ray_placement.PLACEMENT_WAIT_SLICE_S
            if Waiting.waits == 3:
                raise KeyboardInterrupt
            return False

    removed: list[Any] = []
    group = Waiting()
    monkeypatch.setattr(ray_placement, "check_request", lambda spec, error_type: None)
    monkeypatch.setattr(placement, "placement_group", lambda bundles, strategy: group)
    monkeypatch.setattr(placement, "remove_placement_group", removed.append)
    spec = GroupSpec(
        num_workers=1,
        cpus_per_worker=1,
        gpus_per_worker=0,
        use_gpu=False,
        resources_per_worker={"CPU": 1.0},
        placement_timeout_s=600,
    )
    with pytest.raises(KeyboardInterrupt):
        ray_placement.reserve(spec)
    assert removed == [group] and Waiting.waits == 3


def test_rays_error_text_loses_its_colour_codes_and_caret_lines() -> None:
    from lockstep._internal.executors.ray_group import _first_lines

    text = (
        "\x1b[36mray::RayWorker.run()\x1b[39m (pid=12, ip=10.0.0.2)\n  File 'x.py', line 9\n    ^^^^^^\nBoom: it broke"
    )
    assert _first_lines(text) == "ray::RayWorker.run() (pid=12, ip=10.0.0.2) File 'x.py', line 9 Boom: it broke"
