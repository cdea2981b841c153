"""Real multi-process runs on CPU with gloo: ranks, reports, checkpoints, failures."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep import Checkpoint, FailureConfig, Result, RunConfig, ScalingConfig, TrainingFailedError, session
from lockstep.torch import TorchTrainer

pytestmark = pytest.mark.timeout(120)


def _gather(value: object) -> list[object]:
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def report_identity(config: dict) -> dict:
    context = lockstep.get_context()
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"]
    mine = {
        "env": {name: os.environ[name] for name in names},
        "context": [
            context.get_world_rank(),
            context.get_local_rank(),
            context.get_world_size(),
            context.get_local_world_size(),
            context.get_node_rank(),
        ],
        "session": [session.get_world_rank(), session.get_world_size(), session.get_local_rank()],
        "name": context.get_experiment_name(),
        "metadata": context.get_metadata(),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "config": config,
        "device": str(lockstep.torch.get_device()),
    }
    return {"ranks": _gather(mine)}


def test_ranks_env_context_config_and_return_value(storage_path: str) -> None:
    config = {"lr": 0.1, "nested": {"layers": [1, 2]}}
    result = TorchTrainer(
        report_identity,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="identity", storage_path=storage_path),
        metadata={"owner": "tests"},
    ).fit()
    ranks = result.return_value["ranks"]
    ports = {rank["env"]["MASTER_PORT"] for rank in ranks}
    assert len(ports) == 1
    for rank, seen in enumerate(ranks):
        assert seen["env"]["RANK"] == seen["env"]["LOCAL_RANK"] == str(rank)
        assert seen["env"]["WORLD_SIZE"] == seen["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert seen["env"]["NODE_RANK"] == "0" and seen["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert seen["context"] == [rank, rank, 2, 2, 0]
        assert seen["session"] == [rank, 2, rank]
        assert seen["name"] == "identity"
        assert seen["metadata"] == {"owner": "tests"}
        assert seen["threads"] == 1
        assert seen["backend"] == "gloo"
        assert seen["config"] == config
        assert seen["device"] == "cpu"
    assert result.path == str(Path(storage_path) / "identity")
    assert result.metrics is None and result.checkpoint is None


def report_three_times_with_checkpoints() -> None:
    rank = lockstep.get_context().get_world_rank()
    for step in range(3):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, f"rank{rank}.txt").write_text(f"step {step}")
            checkpoint = Checkpoint.from_directory(folder) if step != 1 else None
            lockstep.report({"step": step, "rank": rank, "loss": torch.tensor(1.0 / (step + 1))}, checkpoint=checkpoint)
        latest = lockstep.get_checkpoint()
        assert (
            latest is not None
            and Path(latest.path, f"rank{rank}.txt").read_text() == f"step {0 if step == 1 else step}"
        )


def test_every_report_recorded_and_checkpoints_merged(storage_path: str) -> None:
    result = TorchTrainer(
        report_three_times_with_checkpoints,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="reports", storage_path=storage_path),
    ).fit()
    assert result.metrics == {"step": 2, "rank": 0, "loss": pytest.approx(1 / 3)}
    frame = result.metrics_dataframe
    assert list(frame["report_index"]) == [0, 1, 2]
    assert list(frame["rank"]) == [0, 0, 0]
    assert frame["timestamp"].is_monotonic_increasing
    assert sorted(os.listdir(result.checkpoint.path)) == ["rank0.txt", "rank1.txt"]
    assert Path(result.checkpoint.path, "rank1.txt").read_text() == "step 2"
    assert [metrics["step"] for _, metrics in result.best_checkpoints] == [0, 2]

    again = Result.from_path(result.path)
    assert again.metrics == result.metrics
    assert again.checkpoint == result.checkpoint
    assert list(again.metrics_dataframe["step"]) == [0, 1, 2]


def fail_on_rank_one() -> None:
    lockstep.report({"ok": 1})
    if lockstep.get_context().get_world_rank() == 1:
        raise ValueError("bad batch on purpose")
    lockstep.report({"ok": 2})


def test_failure_names_rank_and_carries_traceback(storage_path: str) -> None:
    trainer = TorchTrainer(
        fail_on_rank_one,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="fails", storage_path=storage_path),
    )
    with pytest.raises(TrainingFailedError) as caught:
        trainer.fit()
    error = caught.value
    assert "rank 1" in str(error)
    assert "ValueError: bad batch on purpose" in str(error)
    assert "in fail_on_rank_one" in str(error)
    assert list(error.failures) == [1]
    assert "Traceback" in error.failures[1].traceback
    recorded = Result.from_path(Path(storage_path, "fails"))
    assert recorded.metrics == {"ok": 1}
    assert "bad batch on purpose" in str(recorded.error)


def return_early_on_rank_zero() -> None:
    if lockstep.get_context().get_world_rank() == 0:
        return
    lockstep.report({"never": "committed"})


def test_rank_that_skips_report_fails_the_run_at_once(storage_path: str) -> None:
    trainer = TorchTrainer(
        return_early_on_rank_zero,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="skip", storage_path=storage_path),
    )
    with pytest.raises(TrainingFailedError, match=r"rank\(s\) 1 wait in report #0"):
        trainer.fit()


def resume_and_fail_once(config: dict) -> int:
    checkpoint = lockstep.get_checkpoint()
    start = 0
    if checkpoint is not None:
        start = int(Path(checkpoint.path, "step.txt").read_text()) + 1
    for step in range(start, 3):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder))
        marker = Path(config["marker"])
        if step == 1 and not marker.exists():
            marker.write_text("crashed once")
            os._exit(3)
    return start


def test_failure_restarts_from_latest_checkpoint(storage_path: str, tmp_path: Path) -> None:
    result = TorchTrainer(
        resume_and_fail_once,
        train_loop_config={"marker": str(tmp_path / "marker")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="restart", storage_path=storage_path, failure_config=FailureConfig(max_failures=1)),
    ).fit()
    assert result.return_value == 2
    assert list(result.metrics_dataframe["step"]) == [0, 1, 2]
    assert list(result.metrics_dataframe["report_index"]) == [0, 1, 2]
    assert result.num_failures == 1
    assert Result.from_path(result.path).num_failures == 1


def test_resume_from_checkpoint_is_visible_on_every_rank(storage_path: str, tmp_path: Path) -> None:
    start = tmp_path / "start"
    start.mkdir()
    (start / "step.txt").write_text("1")
    result = TorchTrainer(
        resume_and_fail_once,
        train_loop_config={"marker": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="resumed", storage_path=storage_path),
        resume_from_checkpoint=Checkpoint.from_directory(start),
    ).fit()
    assert result.return_value == 2
    assert list(result.metrics_dataframe["step"]) == [2]


def read_shards() -> dict:
    shard = lockstep.get_dataset_shard("train")
    items = [int(item) for item in shard]
    batches = [batch.tolist() for batch in shard.iter_torch_batches(batch_size=4)]
    return {"shards": _gather(items), "batches": _gather(batches)}


def test_datasets_are_split_into_equal_disjoint_shards(storage_path: str) -> None:
    result = TorchTrainer(
        read_shards,
        datasets={"train": list(range(11))},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="shards", storage_path=storage_path),
    ).fit()
    first, second = result.return_value["shards"]
    assert len(first) == len(second) == 5
    assert not set(first) & set(second)
    assert result.return_value["batches"][0] == [[0, 1, 2, 3], [4]]


def test_worker_only_functions_refuse_outside_a_run() -> None:
    with pytest.raises(RuntimeError, match="inside the train function"):
        lockstep.report({"x": 1})
    with pytest.raises(RuntimeError, match="inside the train function"):
        lockstep.get_context()
    with pytest.raises(RuntimeError, match="inside the train function"):
        session.get_world_size()


def takes_two(a: int, b: int) -> None:
    return None


def test_bad_input_is_refused_before_any_worker_starts(storage_path: str) -> None:
    import threading

    with pytest.raises(ValueError, match="requires 2 arguments"):
        TorchTrainer(takes_two)
    with pytest.raises(ValueError, match="train_loop_config must be a dict"):
        TorchTrainer(report_identity, train_loop_config=[1, 2])  # type: ignore[arg-type]
    lock = threading.Lock()
    trainer = TorchTrainer(
        report_identity,
        train_loop_config={"lock": lock},
        run_config=RunConfig(name="unpicklable", storage_path=storage_path),
    )
    with pytest.raises(TypeError, match=r"train_loop_config\['lock'\] can't be sent to the workers"):
        trainer.fit()
    assert not Path(storage_path, "unpicklable").exists()
    with pytest.raises(ValueError, match="Custom resources are for Ray clusters"):
        TorchTrainer(
            report_identity, scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1, "custom": 1.0})
        ).fit()


def report_bad_metrics() -> None:
    lockstep.report({"model": object()})


def test_unserializable_metric_names_the_key(storage_path: str) -> None:
    with pytest.raises(TrainingFailedError, match="metric 'model' is a object"):
        TorchTrainer(report_bad_metrics, run_config=RunConfig(storage_path=storage_path)).fit()


def seeded_values() -> dict:
    import random

    import numpy

    lockstep.torch.enable_reproducibility(5)
    return {
        "torch": torch.rand(3).tolist(),
        "random": random.random(),
        "numpy": float(numpy.random.rand()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def test_enable_reproducibility_seeds_everything(storage_path: str) -> None:
    import random

    import numpy

    result = TorchTrainer(
        seeded_values,
        run_config=RunConfig(storage_path=storage_path),
        torch_config=lockstep.torch.TorchConfig(init_method="tcp"),
    ).fit()
    torch.manual_seed(5)
    random.seed(5)
    numpy.random.seed(5)
    assert result.return_value == {
        "torch": torch.rand(3).tolist(),
        "random": random.random(),
        "numpy": float(numpy.random.rand()),
        "deterministic": True,
        "cublas": ":4096:8",
    }


def test_more_gpus_than_the_machine_has_is_refused(storage_path: str) -> None:
    gpus = torch.cuda.device_count()
    trainer = TorchTrainer(report_identity, scaling_config=ScalingConfig(num_workers=gpus + 1, use_gpu=True))
    with pytest.raises(ValueError, match=rf"needs {gpus + 1} GPUs; this machine has {gpus}"):
        trainer.fit()


def crash_while_rank_zero_writes(config: dict) -> None:
    import time

    rank = lockstep.get_context().get_world_rank()
    marker = Path(config["marker"])
    attempt = "second" if marker.exists() else "first"
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, f"rank{rank}_{attempt}.txt").write_text("x")
        if rank == 1 and attempt == "first":
            written = Path(config["run"], "checkpoint_000000", "rank0_first.txt")
            deadline = time.monotonic() + 60
            while not written.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            marker.write_text("crashed")
            os._exit(3)
        lockstep.report({"attempt": attempt}, checkpoint=Checkpoint.from_directory(folder))


def test_restart_does_not_mix_files_of_the_failed_attempt(storage_path: str, tmp_path: Path) -> None:
    result = TorchTrainer(
        crash_while_rank_zero_writes,
        train_loop_config={"marker": str(tmp_path / "marker"), "run": str(Path(storage_path, "mixed"))},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="mixed", storage_path=storage_path, failure_config=FailureConfig(max_failures=1)),
    ).fit()
    assert (tmp_path / "marker").exists(), "the first attempt must have crashed"
    assert sorted(os.listdir(result.checkpoint.path)) == ["rank0_second.txt", "rank1_second.txt"]


def test_default_run_names_are_unique() -> None:
    from lockstep.trainer import default_run_name

    names = {default_run_name("TorchTrainer") for _ in range(20)}
    assert len(names) == 20 and all(name.startswith("TorchTrainer_") for name in names)


def test_datasets_are_checked_before_start() -> None:
    with pytest.raises(ValueError, match="fewer than num_workers=3"):
        TorchTrainer(read_shards, datasets={"train": [1, 2]}, scaling_config=ScalingConfig(num_workers=3))
    with pytest.raises(ValueError, match="only map-style datasets"):
        TorchTrainer(read_shards, datasets={"train": iter(range(5))})
    with pytest.raises(ValueError, match="datasets_to_split"):
        lockstep.DataConfig(datasets_to_split="train")  # type: ignore[arg-type]


def name_a_checkpoint_like_the_record() -> None:
    with tempfile.TemporaryDirectory() as folder:
        lockstep.report({}, checkpoint=Checkpoint.from_directory(folder), checkpoint_dir_name="lockstep_run.json")


def test_checkpoint_names_cannot_clobber_the_run_record(storage_path: str) -> None:
    with pytest.raises(TrainingFailedError, match="must be a plain folder name"):
        TorchTrainer(name_a_checkpoint_like_the_record, run_config=RunConfig(storage_path=storage_path)).fit()


def one_rank_stuck_in_all_reduce() -> None:
    if lockstep.get_context().get_world_rank() == 1:
        dist.all_reduce(torch.ones(1))  # rank 0 never joins
    lockstep.report({"x": 1})


def test_a_rank_that_never_reports_is_failed_with_every_stack(storage_path: str) -> None:
    trainer = TorchTrainer(
        one_rank_stuck_in_all_reduce,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, failure_config=FailureConfig(report_timeout_s=2)),
    )
    with pytest.raises(TrainingFailedError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "rank 1: ReportTimeout: did not call report #0 within 2 s while rank(s) 0 waited in it" in message
    assert "rank 1 was still running, here:" in message
    stack_of_rank_1 = message.split("rank 1 was still running, here:")[1]
    assert "in all_reduce" in stack_of_rank_1 and "in one_rank_stuck_in_all_reduce" in stack_of_rank_1
    assert "rank 0 was still running, here:" in message


def sigkill_rank_one() -> None:
    import signal

    lockstep.report({"before": 1})
    if lockstep.get_context().get_world_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    lockstep.report({"after": 1})


def test_a_sigkilled_worker_fails_the_run_with_the_cause(storage_path: str) -> None:
    trainer = TorchTrainer(
        sigkill_rank_one, scaling_config=ScalingConfig(num_workers=2), run_config=RunConfig(storage_path=storage_path)
    )
    with pytest.raises(TrainingFailedError, match=r"rank 1: WorkerDied: the worker process was killed by SIGKILL"):
        trainer.fit()


def test_requests_no_machine_here_can_meet_are_refused() -> None:
    cpus = os.cpu_count()
    with pytest.raises(ValueError, match=rf"asks for {cpus + 1} CPUs per worker; this machine has {cpus}"):
        TorchTrainer(
            report_identity, scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": cpus + 1})
        ).fit()
    with pytest.raises(ValueError, match="GiB of memory per worker"):
        TorchTrainer(
            report_identity, scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"memory": 2**50})
        ).fit()


def report_many() -> dict:
    def rss_kib() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))

    for index in range(200):
        lockstep.report({"index": index, "loss": 1.0 / (index + 1)})
    before = rss_kib()
    for index in range(1000):
        lockstep.report({"index": index, "loss": 1.0 / (index + 1)})
    return {"worker_growth_kib": rss_kib() - before}


class DriverMemory(lockstep.callbacks.Callback):
    """The driver's RSS (this process: the local executor's driver) after report 199 and 1199."""

    def __init__(self) -> None:
        self.rss_kib: dict[int, int] = {}

    def after_report(self, run: object, index: int, metrics: dict) -> None:
        if index in (199, 1199):
            with open("/proc/self/status") as status:
                self.rss_kib[index] = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def test_soak_a_thousand_reports_keep_memory_flat(storage_path: str) -> None:
    driver = DriverMemory()
    result = TorchTrainer(
        report_many,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, callbacks=[driver]),
    ).fit()
    growth = result.return_value["worker_growth_kib"]
    driver_growth = driver.rss_kib[1199] - driver.rss_kib[199]
    print(f"RSS growth over 1,000 reports: rank 0's worker {growth} KiB, the driver {driver_growth} KiB")
    assert growth < 2048
    # The driver keeps every report's metrics for the Result (~0.5 KiB each); more is a leak.
    assert driver_growth < 4096
    assert len(result.metrics_dataframe) == 1200


def print_then_die_on_rank_one() -> None:
    import sys

    rank = lockstep.get_context().get_world_rank()
    print(f"hello from rank {rank}")
    print(f"warning from rank {rank}", file=sys.stderr)
    lockstep.report({"x": 1})
    if rank == 1:
        print("rank 1 is about to vanish", file=sys.stderr, flush=True)
        os._exit(7)
    lockstep.report({"x": 2})


@pytest.mark.parametrize("mode", ["rank0", "all"])
def test_worker_output_goes_to_log_files_and_the_console(
    storage_path: str, mode: str, capfd: pytest.CaptureFixture
) -> None:
    trainer = TorchTrainer(
        print_then_die_on_rank_one,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="logs", storage_path=storage_path, worker_output=mode),
    )
    with pytest.raises(TrainingFailedError) as caught:
        trainer.fit()
    logs = Path(storage_path, "logs", "logs")
    assert "hello from rank 1" in (logs / "rank_1.log").read_text()
    assert "warning from rank 0" in (logs / "rank_0.log").read_text()
    assert "exited with code 7" in str(caught.value)
    assert "rank 1 is about to vanish" in str(caught.value) and str(logs / "rank_1.log") in str(caught.value)
    console = capfd.readouterr()
    if mode == "rank0":
        assert "hello from rank 0" in console.out and "hello from rank 1" not in console.out
    else:
        assert "[rank 1] hello from rank 1" in console.out and "[rank 0] warning from rank 0" in console.err


def stuck_in_a_collective_while_rank_zero_computes() -> None:
    import time

    if lockstep.get_context().get_world_rank() == 1:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(60)  # a long computation: rank 0 never reaches the collective in time
    lockstep.report({"x": 1})


def test_collective_timeout_names_the_rank_and_shows_where_the_other_was(storage_path: str) -> None:
    trainer = TorchTrainer(
        stuck_in_a_collective_while_rank_zero_computes,
        scaling_config=ScalingConfig(num_workers=2),
        torch_config=lockstep.torch.TorchConfig(timeout_s=3),
        run_config=RunConfig(storage_path=storage_path),
    )
    with pytest.raises(TrainingFailedError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert message.startswith("Training failed on rank 1")
    failure, stack_of_rank_0 = message.split("rank 0 was still running, here:")
    assert "Timed out" in failure and "dist.all_reduce(torch.ones(1))" in failure
    assert "in stuck_in_a_collective_while_rank_zero_computes" in stack_of_rank_0


def test_large_captured_tensors_are_shared_by_the_workers_not_copied(storage_path: str) -> None:
    ones = torch.ones(4 * 2**20)  # 16 MiB, captured by the train function below

    def train_fn() -> None:
        address = ones.data_ptr()
        mapped_from_payload = False
        with open("/proc/self/maps") as maps:
            for line in maps:
                low, high = (int(part, 16) for part in line.split()[0].split("-"))
                mapped_from_payload |= low <= address < high and "lockstep_payload" in line
        if lockstep.get_context().get_world_rank() == 0:
            ones.add_(1)  # copy-on-write: the other rank must not see this
        dist.barrier()
        everyone: list = [None, None]
        dist.all_gather_object(everyone, (mapped_from_payload, float(ones.sum())))
        lockstep.report({"ranks": everyone})

    result = TorchTrainer(
        train_fn, scaling_config=ScalingConfig(num_workers=2), run_config=RunConfig(storage_path=storage_path)
    ).fit()
    assert result.metrics["ranks"] == [[True, 2.0 * ones.numel()], [True, float(ones.numel())]]
    assert float(ones.sum()) == ones.numel()
