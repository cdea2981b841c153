"""Checkpoint validation (``TorchTrainer(validation_config=...)``, ``report(validation=...)``, as in
Ray Train 2.60) and Ray's ``UserCallback``: the retention rule and the driver's validation queue
as units, then real 2-worker runs on the local executor (each validation a fresh process): the
metrics joining the record, failures and timeouts that don't fail the run, ``report()`` not
waiting, ``fit()`` waiting, an interrupted and a killed driver's pending validation run again by
the next ``fit()``. The Ray executor's runs and the comparison with Ray Train itself are in
tests/test_ray.py; Lightning's callback in tests/test_lightning.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, running_after
from validation_fns import WAIT_S, validate_as_told, validate_at_once, validate_value, wait_for

import lockstep
from lockstep import (
    Checkpoint,
    CheckpointConfig,
    CheckpointConsistencyMode,
    CheckpointUploadMode,
    FailureConfig,
    ReportedCheckpointStatus,
    RunConfig,
    ScalingConfig,
    UserCallback,
    ValidationConfig,
    ValidationTaskConfig,
)
from lockstep._internal.executors.local_validation import local_options
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.rank.worker_session import validation_request
from lockstep._internal.run.run_record import RunRecorder
from lockstep._internal.run.validation import (
    RunningValidation,
    ValidationLauncher,
    ValidationOutcome,
    Validations,
    ValidationSetup,
    ValidationTask,
)
from lockstep.torch import TorchTrainer

SCRIPT = REPO_ROOT / "tests" / "scripts" / "validation_abort_job.py"
KEEP_BEST_TWO = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val", checkpoint_score_order="min")


def names(entries: Any) -> list[str]:
    return [entry.dir_name for entry in entries]


# -- the retention rule and the record ---------------------------------------------------------------


def recorder_with_folders(tmp_path: Path, config: CheckpointConfig) -> RunRecorder:
    recorder = RunRecorder(RunStorage.for_run(str(tmp_path), "run"), config, world_size=1)
    recorder.open()
    return recorder


def commit(recorder: RunRecorder, index: int, validation: Any = True) -> str:
    name = f"checkpoint_{index:06d}"
    Path(recorder.storage.checkpoint_path(name)).mkdir()
    recorder.log_report(index, json.dumps({"step": index}), name)
    recorder.commit_checkpoint(name, index, {"step": index}, validation=validation)
    return name


@pytest.mark.parametrize("lag", [0, 1, 4], ids=["each-before-the-next", "one-behind", "all-after-the-last"])
def test_five_checkpoints_validated_5_1_4_2_3_keep_the_best_two_validated(tmp_path: Path, lag: int) -> None:
    """Ray Train 2.60 ends this with 2 and 3 kept (it ranks by the training metrics before the
    validation arrives); lockstep keeps 1 and 2, whenever the validations end."""
    recorder = recorder_with_folders(tmp_path, KEEP_BEST_TWO)
    values = [5, 1, 4, 2, 3]
    ended = 0
    for index in range(len(values)):
        commit(recorder, index)
        while ended < len(values) and ended <= index - lag:
            recorder.finish_validation(f"checkpoint_{ended:06d}", "VALIDATED", {"val": values[ended]})
            ended += 1
    for late in range(ended, len(values)):
        recorder.finish_validation(f"checkpoint_{late:06d}", "VALIDATED", {"val": values[late]})

    result = recorder.result()
    assert [metrics["val"] for _, metrics in result.best_checkpoints] == [2, 1]
    kept = sorted(path.name for path in (tmp_path / "run").glob("checkpoint_*"))
    assert kept == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000004"], "the best two and the latest"


def test_a_checkpoint_awaiting_validation_is_kept_and_not_ranked_until_its_score_is_known(tmp_path: Path) -> None:
    recorder = recorder_with_folders(tmp_path, KEEP_BEST_TWO)
    for index in range(4):
        commit(recorder, index)
    assert names(recorder.pending_validations()) == names(recorder.checkpoints), "nothing is deleted while pending"
    record = recorder.storage.read_record()
    assert record["best_checkpoints"] == []
    assert [entry["validation"] for entry in record["checkpoints"]] == ["PENDING_VALIDATION"] * 4
    assert all(entry["validation_request"] is True for entry in record["checkpoints"]), "kept for a rerun"

    recorder.finish_validation("checkpoint_000000", "VALIDATED", {"val": 0.5, "extra": "x"})
    recorder.finish_validation("checkpoint_000001", "VALIDATION_TIMEOUT", {})
    recorder.finish_validation("checkpoint_000002", "VALIDATION_FAILED", {"val": 0.1})
    record = recorder.storage.read_record()
    by_name = {entry["dir_name"]: entry for entry in record["checkpoints"]}
    assert by_name["checkpoint_000000"]["metrics"] == {"step": 0, "val": 0.5, "extra": "x"}
    assert "validation_request" not in by_name["checkpoint_000000"]
    assert "checkpoint_000001" not in by_name, "unscored, it ranks last: beyond num_to_keep once its validation ended"
    assert not (tmp_path / "run" / "checkpoint_000001").exists()
    assert by_name["checkpoint_000002"]["metrics"] == {"step": 2}, "a failed validation's metrics are not kept"
    assert by_name["checkpoint_000002"]["validation"] == "VALIDATION_FAILED"
    assert by_name["checkpoint_000003"]["validation"] == "PENDING_VALIDATION"
    assert record["best_checkpoints"] == ["checkpoint_000002", "checkpoint_000000"], "unscored ones rank last"


def test_a_record_without_validations_is_written_as_before(tmp_path: Path) -> None:
    recorder = recorder_with_folders(tmp_path, CheckpointConfig())
    commit(recorder, 0, validation=None)
    (entry,) = recorder.storage.read_record()["checkpoints"]
    assert set(entry) == {"dir_name", "report_index", "metrics", "path"}


# -- the driver's queue, with a scripted launcher ------------------------------------------------------


class ScriptedValidation(RunningValidation):
    def __init__(self, task: ValidationTask) -> None:
        self.task, self.outcome, self.cancelled = task, None, False

    def wait(self, timeout: float | None) -> ValidationOutcome | None:
        return self.outcome

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedLauncher(ValidationLauncher):
    def __init__(self) -> None:
        self.started: list[ScriptedValidation] = []

    def start(self, task: ValidationTask) -> RunningValidation:
        self.started.append(ScriptedValidation(task))
        return self.started[-1]


def statuses(recorder: RunRecorder) -> dict[str, str | None]:
    return {entry.dir_name: entry.validation for entry in recorder.checkpoints}


def test_one_validation_at_a_time_with_merged_kwargs_timeouts_and_failures(tmp_path: Path) -> None:
    recorder = recorder_with_folders(tmp_path, CheckpointConfig())
    launcher = ScriptedLauncher()
    defaults = ValidationTaskConfig(fn_kwargs={"split": "val", "scale": 1}, timeout_s=60)
    validations = Validations(ValidationSetup(ValidationConfig(lambda checkpoint: {}, defaults), launcher), recorder)
    requests = [True, {"fn_kwargs": {"scale": 2}, "timeout_s": None}, {"fn_kwargs": {}, "timeout_s": 0.05}]
    for index, request in enumerate(requests):
        commit(recorder, index, validation=request)
        validations.submit(recorder.checkpoints[-1])
    assert len(launcher.started) == 1, "one at a time (Ray's MAX_IN_FLIGHT_VALIDATIONS)"
    assert launcher.started[0].task.fn_kwargs == {"split": "val", "scale": 1}

    launcher.started[0].outcome = ValidationOutcome(metrics={"val": 3})
    validations.poll()
    assert launcher.started[1].task.fn_kwargs == {"split": "val", "scale": 2}, "the report's kwargs win"
    assert validations.time_left() is not None and validations.time_left() <= 0.2
    launcher.started[1].outcome = ValidationOutcome(error="Traceback ...\nValueError: bad")
    validations.poll()
    time.sleep(0.06)
    validations.poll()
    assert launcher.started[2].cancelled, "timed out"
    assert statuses(recorder) == {
        "checkpoint_000000": "VALIDATED",
        "checkpoint_000001": "VALIDATION_FAILED",
        "checkpoint_000002": "VALIDATION_TIMEOUT",
    }
    assert not validations.pending and validations.time_left() is None


def test_pending_validations_of_the_record_are_queued_and_an_abort_leaves_them_pending(tmp_path: Path) -> None:
    recorder = recorder_with_folders(tmp_path, CheckpointConfig())
    for index in range(2):
        commit(recorder, index, validation={"fn_kwargs": {"n": index}, "timeout_s": None})
    again = RunRecorder(recorder.storage, CheckpointConfig(), world_size=1)
    launcher = ScriptedLauncher()
    validations = Validations(ValidationSetup(ValidationConfig(lambda checkpoint: {}), launcher), again)
    validations.poll()
    assert [started.task.fn_kwargs for started in launcher.started] == [{"n": 0}]
    validations.abort()
    assert launcher.started[0].cancelled
    assert set(statuses(RunRecorder(recorder.storage, CheckpointConfig(), world_size=1)).values()) == {
        "PENDING_VALIDATION"
    }


# -- what is refused, before anything runs --------------------------------------------------------------


def test_report_validation_needs_a_checkpoint_a_validation_config_and_json_kwargs(tmp_path: Path) -> None:
    checkpoint = Checkpoint.from_directory(str(tmp_path))
    assert validation_request(False, None, has_validation=False) is None
    assert validation_request(True, checkpoint, has_validation=True) is True
    assert validation_request(ValidationTaskConfig({"k": [1, "a"]}, 5), checkpoint, has_validation=True) == {
        "fn_kwargs": {"k": [1, "a"]},
        "timeout_s": 5,
    }
    with pytest.raises(ValueError, match="needs a checkpoint"):
        validation_request(True, None, has_validation=True)
    with pytest.raises(ValueError, match="validation_config=lockstep.ValidationConfig"):
        validation_request(True, checkpoint, has_validation=False)
    with pytest.raises(TypeError, match="JSON-serializable"):
        validation_request(ValidationTaskConfig({"k": object()}), checkpoint, has_validation=True)
    with pytest.raises(TypeError, match="True, False or"):
        validation_request("yes", checkpoint, has_validation=True)


def test_configs_refuse_wrong_values() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        ValidationTaskConfig(timeout_s=0)
    with pytest.raises(ValueError, match="must be a function"):
        ValidationConfig(fn=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\['resources'\], which only a Ray cluster"):
        local_options({"num_cpus": 1, "resources": {"TPU": 1}})
    with pytest.raises(ValueError, match="this machine has"):
        local_options({"num_cpus": 10_000})
    assert local_options({"num_gpus": 0, "max_retries": 0}).num_cpus == 1


# -- real runs on the local executor ------------------------------------------------------------------


def value_checkpoint(folder: str, value: float) -> Checkpoint:
    if lockstep.get_context().get_world_rank() == 0:
        Path(folder, "value.txt").write_text(str(value))
    return Checkpoint.from_directory(folder)


def report_5_1_4_2_3(config: dict[str, Any]) -> dict[str, Any]:
    for step, value in enumerate([5, 1, 4, 2, 3]):
        with tempfile.TemporaryDirectory() as folder:
            lockstep.report({"step": step}, checkpoint=value_checkpoint(folder, value), validation=True)
    validated = lockstep.get_all_reported_checkpoints()
    return {
        "pid": os.getpid(),
        "validated": [(seen.metrics["step"], seen.status.value, seen.metrics.get("val")) for seen in validated],
    }


@pytest.mark.timeout(120)
def test_validated_metrics_rank_the_checkpoints_and_fit_waits_for_them(storage_path: str) -> None:
    result = TorchTrainer(
        report_5_1_4_2_3,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="best", storage_path=storage_path, checkpoint_config=KEEP_BEST_TWO),
        validation_config=ValidationConfig(validate_value, ray_remote_kwargs={"num_cpus": 2}),
    ).fit()

    assert [(metrics["step"], metrics["val"]) for _, metrics in result.best_checkpoints] == [(3, 2.0), (1, 1.0)]
    kept = sorted(path.name for path in Path(result.path).glob("checkpoint_*"))
    assert kept == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000004"]
    assert result.metrics is not None and result.metrics["val"] == 3.0, "the last checkpoint was validated by now"
    record = json.loads(Path(result.path, "lockstep_run.json").read_text())
    assert {entry["validation"] for entry in record["checkpoints"]} == {"VALIDATED"}, "fit() waited for them all"
    pids = {entry["metrics"]["pid"] for entry in record["checkpoints"]}
    assert len(pids) == 3 and result.return_value["pid"] not in pids, "a fresh process per validation"
    assert {entry["metrics"]["threads"] for entry in record["checkpoints"]} == {"2"}, "num_cpus=2 -> 2 threads"
    assert {entry["metrics"]["gpus"] for entry in record["checkpoints"]} == {""}, "no num_gpus: no GPU, as in Ray"
    # VALIDATED (the default) waited in the train function for every validation; kept ones, worst first
    assert result.return_value["validated"] == [(4, "VALIDATED", 3.0), (3, "VALIDATED", 2.0), (1, "VALIDATED", 1.0)]


def report_while_validating(config: dict[str, Any]) -> dict[str, Any]:
    marks = Path(config["marks"])
    rank = lockstep.get_context().get_world_rank()
    modes = [
        ValidationTaskConfig({"mode": "wait"}),
        ValidationTaskConfig({"mode": "fail"}),
        ValidationTaskConfig({"mode": "hang"}, timeout_s=1),
        ValidationTaskConfig({"scale": 10.0}),
        True,
    ]
    seen: dict[str, Any] = {}
    for step, validation in enumerate(modes):
        with tempfile.TemporaryDirectory() as folder:
            lockstep.report(
                {"step": step},
                checkpoint=value_checkpoint(folder, step + 1),
                validation=validation,
                checkpoint_upload_mode=CheckpointUploadMode.ASYNC if step == 3 else "SYNC",
            )
        if step == 0 and rank == 0:  # report() has returned: the validation runs on its own
            wait_for(Path(marks, "started").exists, "the first validation's start")
            committed = lockstep.get_all_reported_checkpoints(CheckpointConsistencyMode.COMMITTED)
            seen["committed_while_validating"] = [reported.status.value for reported in committed]
            seen["finished_before_go"] = Path(marks, "finished").exists()
            Path(marks, "go").touch()
    return seen


class RecordingCallback(UserCallback):
    def __init__(self) -> None:
        self.reports: list[tuple[list[dict[str, Any]], str | None]] = []

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        assert run_context.get_run_config().name == "told"
        self.reports.append((metrics, Path(checkpoint.path).name if checkpoint else None))


@pytest.mark.timeout(120)
def test_failed_and_timed_out_validations_mark_their_checkpoints_without_failing_the_run(
    storage_path: str, tmp_path: Path
) -> None:
    callback = RecordingCallback()
    defaults = ValidationTaskConfig(fn_kwargs={"marks": str(tmp_path), "scale": 2.0})
    result = TorchTrainer(
        report_while_validating,
        train_loop_config={"marks": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="told", storage_path=storage_path, callbacks=[callback]),
        validation_config=ValidationConfig(validate_as_told, defaults, ray_remote_kwargs={"max_retries": 0}),
    ).fit()

    assert result.return_value == {"finished_before_go": False, "committed_while_validating": ["PENDING_VALIDATION"]}, (
        "report(validation=...) and get_all_reported_checkpoints(COMMITTED) did not wait for the validation"
    )
    record = json.loads(Path(result.path, "lockstep_run.json").read_text())
    assert record["status"] == "finished"
    got = [
        (entry["validation"], entry["metrics"].get("val"), entry["metrics"].get("scale"))
        for entry in record["checkpoints"]
    ]
    assert got == [
        ("VALIDATED", 2.0, 2.0),
        ("VALIDATION_FAILED", None, None),
        ("VALIDATION_TIMEOUT", None, None),
        ("VALIDATED", 40.0, 10.0),
        ("VALIDATED", 10.0, 2.0),
    ]
    log = Path(result.path, "logs", "validation_checkpoint_000001.log")
    assert log.exists()
    # Ray's UserCallback: every report in order, every rank's metrics, the committed checkpoint
    assert [metrics for metrics, _ in callback.reports] == [[{"step": step}] * 2 for step in range(5)]
    assert [name for _, name in callback.reports] == [f"checkpoint_{step:06d}" for step in range(5)]


def fail_once_on_rank_1(config: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        lockstep.report({"rank": lockstep.get_context().get_world_rank()}, checkpoint=Checkpoint.from_directory(folder))
    if lockstep.get_context().get_world_rank() == 1 and not Path(config["failed"]).exists():
        Path(config["failed"]).touch()
        raise RuntimeError("rank 1 trips once")


class ExceptionsCallback(UserCallback):
    def __init__(self) -> None:
        self.exceptions: list[dict[int, Exception]] = []
        self.metrics: list[list[dict[str, Any]]] = []

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        self.metrics.append(metrics)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self.exceptions.append(worker_exceptions)


@pytest.mark.timeout(120)
def test_user_callback_hears_of_a_failed_rank(storage_path: str, tmp_path: Path) -> None:
    callback = ExceptionsCallback()
    TorchTrainer(
        fail_once_on_rank_1,
        train_loop_config={"failed": str(tmp_path / "failed")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=storage_path, callbacks=[callback], failure_config=FailureConfig(max_failures=1)
        ),
    ).fit()
    assert [sorted(exceptions) for exceptions in callback.exceptions] == [[1]]
    assert "rank 1 trips once" in str(callback.exceptions[0][1])
    assert callback.metrics == [[{"rank": 0}, {"rank": 1}]] * 2


# -- an interrupted or killed driver ---------------------------------------------------------------


def start_driver(storage_path: str, marks: Path) -> subprocess.Popen[bytes]:
    from conftest import sigint_raises

    return subprocess.Popen(
        [sys.executable, str(SCRIPT), storage_path, str(marks)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=sigint_raises,
    )


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie its parent has not reaped yet counts as ended)."""
    return not running_after({pid}, 0, zombies_count=False)


def report_nothing_new() -> None:
    assert lockstep.get_checkpoint() is not None, "the run resumes from its checkpoint"


@pytest.mark.timeout(150)
def test_an_interrupted_or_killed_drivers_pending_validation_runs_at_the_next_fit(
    storage_path: str, tmp_path: Path
) -> None:
    record = Path(storage_path, "aborted", "lockstep_run.json")
    driver = start_driver(storage_path, tmp_path)
    try:
        wait_for(Path(tmp_path, "started_1").exists, "the validation's start")
        validating = int(Path(tmp_path, "started_1").read_text())
        driver.send_signal(signal.SIGINT)  # Ctrl-C while fit() waits for the validation
        assert driver.wait(WAIT_S) != 0
        wait_for(lambda: gone(validating), "the end of the interrupted run's validation", 10)
        first = json.loads(record.read_text())
        assert first["status"] == "interrupted"
        assert [entry["validation"] for entry in first["checkpoints"]] == ["PENDING_VALIDATION"]

        driver = start_driver(storage_path, tmp_path)  # the next run starts it again ...
        wait_for(Path(tmp_path, "started_2").exists, "the pending validation's second start")
        validating = int(Path(tmp_path, "started_2").read_text())
        os.killpg(driver.pid, signal.SIGKILL)  # ... and its driver is killed
        driver.wait(WAIT_S)
        wait_for(lambda: gone(validating), "the killed driver's validation to end", 10)
        assert json.loads(record.read_text())["checkpoints"][0]["validation"] == "PENDING_VALIDATION"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()

    result = TorchTrainer(
        report_nothing_new,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="aborted", storage_path=storage_path),
        validation_config=ValidationConfig(validate_at_once, ValidationTaskConfig({"marks": str(tmp_path)})),
    ).fit()
    (entry,) = json.loads(record.read_text())["checkpoints"]
    assert (entry["validation"], entry["metrics"]) == ("VALIDATED", {"step": 0, "val": 7})
    assert result.best_checkpoints[0][1] == {"step": 0, "val": 7}
    assert ReportedCheckpointStatus(entry["validation"]) is ReportedCheckpointStatus.VALIDATED


def report_two_in_local_mode() -> None:
    for step in range(2):
        with tempfile.TemporaryDirectory() as folder:
            lockstep.report({"step": step}, checkpoint=value_checkpoint(folder, step + 1), validation=True)


@pytest.mark.timeout(60)
def test_local_mode_validates_in_a_process_of_its_own(storage_path: str) -> None:
    result = TorchTrainer(
        report_two_in_local_mode,
        scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(storage_path=storage_path),
        validation_config=ValidationConfig(validate_value),
    ).fit()
    validated = [metrics for _, metrics in result.best_checkpoints]
    assert [(metrics["val"], metrics["pid"] != os.getpid()) for metrics in validated] == [(1.0, True), (2.0, True)]


@pytest.mark.timeout(150)
def test_under_torchrun_rank_0_validates_in_processes_of_their_own(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--max-restarts=0",
            str(REPO_ROOT / "tests" / "scripts" / "validation_torchrun_job.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    results = {}
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            _, rank, pid, best = line.split(" ", 3)
            results[int(rank)] = (int(pid), json.loads(best))
    assert sorted(results) == [0, 1]
    (pid_0, best), (pid_1, best_seen_by_1) = results[0], results[1]
    assert [(metrics["val"], metrics["rank_variable"]) for metrics in best] == [(1.0, None), (2.0, None)]
    assert not {metrics["pid"] for metrics in best} & {pid_0, pid_1}, "not in a rank's process"
    assert best_seen_by_1 == best
