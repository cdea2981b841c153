"""Local mode: ScalingConfig(num_workers=0) runs the train function in the driver process (as
Ray Train 2.x does), with the usual report / checkpoint / Result semantics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO_ROOT, running_after, sigint_raises
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep import Checkpoint, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from lockstep._internal.executors import choose_executor
from lockstep._internal.executors.local_mode import LocalModeExecutor
from lockstep.torch import TorchTrainer, prepare_data_loader, prepare_model

pytestmark = pytest.mark.timeout(60)

LOCAL_MODE = ScalingConfig(num_workers=0)


def _trainer(train_fn, storage_path: str, name: str, **kwargs) -> TorchTrainer:
    return TorchTrainer(
        train_fn,
        scaling_config=LOCAL_MODE,
        run_config=RunConfig(name=name, storage_path=storage_path, failure_config=kwargs.pop("failure_config", None)),
        **kwargs,
    )


def test_num_workers_0_chooses_the_local_mode_executor() -> None:
    executor = choose_executor(LOCAL_MODE, {})
    assert isinstance(executor, LocalModeExecutor) and executor.name == "local_mode"


def test_local_mode_with_ray_asked_for_is_refused_before_anything_runs(storage_path: str) -> None:
    with pytest.raises(ValueError, match="local mode"):
        choose_executor(ScalingConfig(num_workers=0, executor="ray"), {})


# -- what the train function sees -----------------------------------------------------------------


def identity(config: dict) -> dict:
    context = lockstep.get_context()
    return {
        "pid": os.getpid(),
        "thread": threading.current_thread() is threading.main_thread(),
        "context": [
            context.get_world_rank(),
            context.get_world_size(),
            context.get_local_rank(),
            context.get_local_world_size(),
            context.get_node_rank(),
        ],
        "session": [lockstep.session.get_world_rank(), lockstep.session.get_world_size()],
        "name": context.get_experiment_name(),
        "run_path": context.get_storage().run_path,
        "metadata": context.get_metadata(),
        "process_group": dist.is_initialized(),
        "device": str(lockstep.torch.get_device()),
        "config": config,
        "threads": torch.get_num_threads(),
        "checkpoint": lockstep.get_checkpoint(),
    }


def test_the_train_function_runs_in_this_process_on_the_main_thread(storage_path: str) -> None:
    config = {"lr": 0.1, "tensor": torch.ones(2)}
    threads = torch.get_num_threads()
    result = _trainer(identity, storage_path, "identity", train_loop_config=config, metadata={"owner": "tests"}).fit()
    seen = result.return_value
    assert seen["pid"] == os.getpid() and seen["thread"]
    assert seen["context"] == [0, 1, 0, 1, 0] and seen["session"] == [0, 1]
    assert seen["name"] == "identity" and seen["metadata"] == {"owner": "tests"}
    assert seen["run_path"].endswith("identity") and result.path == str(Path(storage_path) / "identity")
    assert not seen["process_group"] and seen["device"] == "cpu"
    assert seen["config"]["tensor"] is config["tensor"]  # not pickled: the very object
    assert seen["threads"] == threads and torch.get_num_threads() == threads
    assert seen["checkpoint"] is None
    record = json.loads((Path(storage_path) / "identity" / "lockstep_run.json").read_text())
    assert record["executor"] == "local_mode" and record["world_size"] == 1 and record["status"] == "finished"
    with pytest.raises(RuntimeError):
        lockstep.report({"outside": 1})  # the session ended with the run


# -- reports, checkpoints, Result ------------------------------------------------------------------


def report_with_checkpoints(config: dict) -> str:
    start = 0
    checkpoint = lockstep.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            start = int(Path(folder, "step.txt").read_text()) + 1
    for step in range(start, config["steps"]):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            with_checkpoint = step % 2 == 0
            lockstep.report(
                {"step": step, "loss": torch.tensor(1.0 / (step + 1))},
                checkpoint=Checkpoint.from_directory(folder) if with_checkpoint else None,
            )
        if step == config.get("fail_at"):
            raise ValueError(f"boom at step {step}")
    return "done"


def _step_in(checkpoint: Checkpoint) -> int:
    with checkpoint.as_directory() as folder:
        return int(Path(folder, "step.txt").read_text())


def test_reports_checkpoints_and_result(storage_path: str) -> None:
    result = _trainer(report_with_checkpoints, storage_path, "reports", train_loop_config={"steps": 4}).fit()
    assert result.return_value == "done"
    assert result.metrics["step"] == 3 and result.metrics["loss"] == pytest.approx(0.25)
    assert list(result.metrics_dataframe["step"]) == [0, 1, 2, 3]
    assert _step_in(result.checkpoint) == 2
    assert [_step_in(checkpoint) for checkpoint, _ in result.best_checkpoints] == [0, 2]
    assert result.error is None
    reloaded = lockstep.Result.from_path(result.path)
    assert reloaded.metrics["step"] == 3 and _step_in(reloaded.checkpoint) == 2


def test_a_failure_raises_with_the_traceback_and_a_rerun_resumes_from_the_checkpoint(storage_path: str) -> None:
    config = {"steps": 5, "fail_at": 3}
    trainer = _trainer(
        report_with_checkpoints,
        storage_path,
        "resume",
        train_loop_config=config,
        failure_config=FailureConfig(max_failures=3),
    )
    with pytest.raises(TrainingFailedError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "ValueError: boom at step 3" in message and "report_with_checkpoints" in message
    assert caught.value.failures[0].error_type == "ValueError"
    assert "_internal" not in caught.value.failures[0].traceback  # the user's frames only
    assert lockstep.Result.from_path(str(Path(storage_path) / "resume")).metrics["step"] == 3  # no restart
    config.pop("fail_at")
    result = _trainer(report_with_checkpoints, storage_path, "resume", train_loop_config=config).fit()
    assert list(result.metrics_dataframe["step"]) == [0, 1, 2, 3, 3, 4]  # resumed after step 2's checkpoint
    assert _step_in(result.checkpoint) == 4


def interrupted() -> None:
    lockstep.report({"step": 0})
    raise KeyboardInterrupt


def test_ctrl_c_in_the_train_function_reaches_the_caller(storage_path: str) -> None:
    with pytest.raises(KeyboardInterrupt):
        _trainer(interrupted, storage_path, "interrupted").fit()
    result = lockstep.Result.from_path(str(Path(storage_path) / "interrupted"))
    assert result.metrics == {"step": 0} and result.error is not None
    assert threading.active_count() == 1 or all(
        not thread.name.startswith("lockstep") for thread in threading.enumerate()
    )


# -- prepare_model / prepare_data_loader without a process group ------------------------------------


def prepared_training() -> dict:
    torch.manual_seed(0)
    model = prepare_model(nn.Linear(3, 1))
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    loader = prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 0
    for features, targets in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(features), targets).backward()
        optimizer.step()
        batches += 1
    lockstep.report({"batches": batches})
    return {"model": type(model).__name__, "batches": batches, "sampler": type(loader.sampler).__name__}


def test_prepare_model_and_data_loader_work_without_a_process_group(storage_path: str) -> None:
    result = _trainer(prepared_training, storage_path, "prepared").fit()
    assert result.return_value == {"model": "Linear", "batches": 4, "sampler": "RandomSampler"}
    assert result.metrics == {"batches": 4} and not dist.is_initialized()


def read_dataset_shard() -> int:
    return len(lockstep.get_dataset_shard("train"))


def test_a_torch_dataset_is_the_only_ranks_whole_shard(storage_path: str) -> None:
    data = TensorDataset(torch.arange(10.0))
    result = _trainer(read_dataset_shard, storage_path, "shard", datasets={"train": data}).fit()
    assert result.return_value == 10


# -- a debugger, and torchrun -----------------------------------------------------------------------

DEBUGGED_SCRIPT = """
import os, sys
import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

def train_func():
    step = 41
    breakpoint()
    lockstep.report({"step": step + 1})

print("DRIVER", os.getpid(), flush=True)
result = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=0),
                      run_config=RunConfig(name="debugged", storage_path=sys.argv[1], verbose=0)).fit()
print("METRICS", result.metrics, flush=True)
"""


def test_a_breakpoint_in_the_train_function_stops_the_driver_in_pdb(tmp_path: Path) -> None:
    script = tmp_path / "debugged.py"
    script.write_text(DEBUGGED_SCRIPT)
    commands = "p ('SEEN', os.getpid(), lockstep.get_context().get_world_size(), step)\n!step = 99\nc\n"
    completed = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "results")],
        input=commands,
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PYTHONBREAKPOINT": ""},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    driver_pid = int(completed.stdout.split("DRIVER ", 1)[1].split()[0])
    assert f"('SEEN', {driver_pid}, 1, 41)" in completed.stdout
    assert "METRICS {'step': 100}" in completed.stdout  # the value set in pdb reached report()


TORCHRUN_SCRIPT = """
import json, os, sys
import torch.distributed as dist
import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

def train_func():
    context = lockstep.get_context()
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, [context.get_world_rank(), context.get_world_size(), os.getpid()])
    lockstep.report({"ranks": ranks})

result = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=0),
                      run_config=RunConfig(name="torchrun_local_mode", storage_path=sys.argv[1], verbose=0)).fit()
# one write of the whole line: both ranks share torchrun's stdout, and print() writes its pieces apart
sys.stdout.write(f"RESULT {os.environ['RANK']} {os.getpid()} {json.dumps(result.metrics['ranks'])}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(150)
def test_under_torchrun_num_workers_0_makes_each_process_a_rank(tmp_path: Path) -> None:
    script = tmp_path / "torchrun_local_mode.py"
    script.write_text(TORCHRUN_SCRIPT)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--max-restarts=0",
            str(script),
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    results = sorted(line.split(" ", 3)[1:] for line in completed.stdout.splitlines() if line.startswith("RESULT "))
    assert [rank for rank, _, _ in results] == ["0", "1"], completed.stdout
    pids = [int(pid) for _, pid, _ in results]
    for _, _, seen in results:  # every rank's Result holds rank 0's report: both ranks, each in its own process
        assert json.loads(seen) == [[0, 2, pids[0]], [1, 2, pids[1]]]


def iterate_ray_shard() -> list[float]:
    shard = lockstep.get_dataset_shard("train")
    return sorted(float(value) for batch in shard.iter_torch_batches(batch_size=4) for value in batch["x"])


@pytest.mark.timeout(120)
def test_a_ray_dataset_is_handed_over_whole(storage_path: str) -> None:
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # not a cluster others run here
    try:
        dataset = ray.data.from_items([{"x": float(value)} for value in range(10)])
        result = _trainer(iterate_ray_shard, storage_path, "ray_data", datasets={"train": dataset}).fit()
    finally:
        ray.shutdown()
    assert result.return_value == [float(value) for value in range(10)]


def collectives_and_reported_checkpoints() -> dict:
    from lockstep.collective import barrier, broadcast_from_rank_zero

    barrier()
    token = broadcast_from_rank_zero({"token": 7})
    for step in range(2):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder))
    reported = lockstep.get_all_reported_checkpoints()
    return {"token": token, "reported": [(_step_in(item.checkpoint), item.metrics["step"]) for item in reported]}


def test_collectives_and_reported_checkpoints_work_in_local_mode(storage_path: str) -> None:
    result = _trainer(collectives_and_reported_checkpoints, storage_path, "collectives").fit()
    assert result.return_value == {"token": {"token": 7}, "reported": [(0, 0), (1, 1)]}


def device_seen() -> list[str]:
    return [str(lockstep.torch.get_device()), str(next(prepare_model(nn.Linear(2, 2)).parameters()).device)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_with_use_gpu_the_device_is_the_current_gpu(storage_path: str) -> None:
    result = TorchTrainer(
        device_seen,
        scaling_config=ScalingConfig(num_workers=0, use_gpu=True),
        run_config=RunConfig(name="gpu", storage_path=storage_path),
    ).fit()
    expected = f"cuda:{torch.cuda.current_device()}"
    assert result.return_value == [expected, expected]


INTERRUPTED_SCRIPT = """
import sys, time
import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

def train_func():
    lockstep.report({"step": 0})
    print("READY", flush=True)
    while True:
        time.sleep(0.05)

TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=0),
             run_config=RunConfig(name="sigint", storage_path=sys.argv[1], verbose=0)).fit()
"""


def test_sigint_interrupts_the_train_function_and_fit_raises_keyboard_interrupt(tmp_path: Path) -> None:
    from conftest import sigint_raises

    script = tmp_path / "sigint.py"
    script.write_text(INTERRUPTED_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "results")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_raises,
    )
    try:
        assert process.stdout.readline().strip() == "READY"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait()
    assert process.returncode != 0 and stderr.rstrip().endswith("KeyboardInterrupt"), stderr
    record = json.loads((tmp_path / "results" / "sigint" / "lockstep_run.json").read_text())
    assert record["status"] == "failed"


PREEMPTED_SCRIPT = """
import pathlib, sys, tempfile, time
import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

def train_func():
    for step in range(10_000):
        with tempfile.TemporaryDirectory() as folder:
            pathlib.Path(folder, "step.txt").write_text(str(step))
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder))
        print("REPORTED", flush=True)
        time.sleep(0.05)

try:
    TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=0),
                 run_config=RunConfig(name="preempted", storage_path=sys.argv[1], verbose=0)).fit()
except lockstep.PreemptionError as error:
    print("PREEMPTED", error.preemption_info.preempted_ranks if error.preemption_info else None, flush=True)
"""


def test_sigterm_is_a_preemption_notice_in_local_mode_too(tmp_path: Path) -> None:
    script = tmp_path / "preempted.py"
    script.write_text(PREEMPTED_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "results")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "REPORTED"
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=40)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0 and "PREEMPTED [0]" in stdout, stdout + stderr
    record = json.loads((tmp_path / "results" / "preempted" / "lockstep_run.json").read_text())
    assert record["status"] == "preempted"


@pytest.mark.timeout(120)
def test_ctrl_c_while_fit_waits_for_a_validation_records_the_run_interrupted(tmp_path: Path) -> None:

    marker = tmp_path / "validation_pid"
    script = Path(__file__).parent / "scripts" / "local_mode_ctrl_c.py"
    driver = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(marker)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_raises,
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() or not marker.read_text():
            assert driver.poll() is None, f"the driver ended before the validation started: {driver.communicate()}"
            assert time.monotonic() < deadline, "the validation never started"
            time.sleep(0.05)
        validation_pid = int(marker.read_text())
        driver.send_signal(signal.SIGINT)
        _, stderr = driver.communicate(timeout=60)
    finally:
        driver.kill()
        driver.wait()
    assert driver.returncode != 0 and "KeyboardInterrupt" in stderr, stderr
    record = json.loads((tmp_path / "ctrl-c" / "lockstep_run.json").read_text())
    assert record["status"] == "interrupted", f"the record says {record['status']!r}\n{stderr}"
    assert record["checkpoints"][0]["validation"] == "PENDING_VALIDATION"  # the next run validates it
    assert not running_after([validation_pid], 10), "the validation process outlived the interrupted run"
