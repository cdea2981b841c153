"""Callbacks and the built-in loggers, on real runs; each logger's output is read back with its
own tool (csv, json, TensorBoard's event reader, the MLflow client). Then the one interface the
controller tells everything through: its hook names, and lockstep's own listeners on it (the log
lines, the progress line)."""

from __future__ import annotations

import ast
import csv
import io
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest

import lockstep
from lockstep import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from lockstep._internal.output import progress
from lockstep._internal.output.listeners import Listeners, LogLines, listeners_for
from lockstep._internal.run import attempt_events, controller
from lockstep.callbacks import AttemptStart, Callback, CSVLogger, JSONLogger, MLflowLogger, RunInfo, TensorBoardLogger
from lockstep.torch import TorchTrainer


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_run_start(self, run: RunInfo) -> None:
        self.calls.append(("start", run.name, run.world_size))

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("report", index, metrics["loss"]))

    def on_checkpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
        self.calls.append(("checkpoint", index, Path(checkpoint.path).name))

    def on_failure(self, run: RunInfo, error: Exception, restarting: bool) -> None:
        self.calls.append(("failure", restarting, "on purpose" in str(error)))

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        self.calls.append(("end", status, error is None))


def three_reports_one_failure() -> None:
    """Reports 0 and 1 (checkpoint at 1), fails once before report 2, then finishes."""
    start = lockstep.get_checkpoint()
    first = 2 if start else 0
    for step in range(first, 3):
        if step == 1:
            with tempfile.TemporaryDirectory() as folder:
                lockstep.report({"step": step, "loss": 1.0 / (step + 1)}, checkpoint=Checkpoint.from_directory(folder))
        else:
            lockstep.report({"step": step, "loss": 1.0 / (step + 1), "note": "text"})
        if step == 1 and start is None:
            raise RuntimeError("failing on purpose")


def fit_with(callbacks: list[Callback], storage_path: str, name: str = "cb", max_failures: int = 1) -> lockstep.Result:
    return TorchTrainer(
        three_reports_one_failure,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            callbacks=callbacks,
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    ).fit()


def test_hooks_are_called_in_order_through_a_restart(storage_path: str) -> None:
    recorder = Recorder()
    fit_with([recorder], storage_path)
    assert recorder.calls == [
        ("start", "cb", 2),
        ("report", 0, 1.0),
        ("report", 1, 0.5),
        ("checkpoint", 1, "checkpoint_000001"),
        ("failure", True, True),
        ("report", 2, 1 / 3),
        ("end", "finished", True),
    ]


class Broken(Callback):
    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        raise ValueError("a broken logger")


def test_a_failing_callback_is_switched_off_and_training_goes_on(
    storage_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    with caplog.at_level(logging.ERROR, logger="lockstep"):
        result = fit_with([Broken(), recorder], storage_path)
    assert result.metrics["step"] == 2
    assert [call[0] for call in recorder.calls].count("report") == 3
    errors = [record.getMessage() for record in caplog.records if "Callback Broken failed" in record.getMessage()]
    assert len(errors) == 1 and "ValueError: a broken logger" in errors[0]


def test_csv_and_json_loggers_write_every_report(storage_path: str) -> None:
    fit_with([CSVLogger(), JSONLogger()], storage_path)
    logs = Path(storage_path, "cb", "logs")
    with open(logs / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["report_index"] for row in rows] == ["0", "1", "2"]
    assert [row["note"] for row in rows] == ["text", "", "text"]
    lines = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]


def test_tensorboard_logger_scalars_read_back(storage_path: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fit_with([TensorBoardLogger()], storage_path)
    events = EventAccumulator(str(Path(storage_path, "cb", "logs", "tensorboard")))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "step"]
    assert [(event.step, round(event.value, 4)) for event in events.Scalars("loss")] == [
        (0, 1.0),
        (1, 0.5),
        (2, 0.3333),
    ]


def test_mlflow_logger_run_reads_back(storage_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store, read-mostly
    uri = (tmp_path / "mlruns").as_uri()
    logger_callback = MLflowLogger(tracking_uri=uri, experiment_name="lockstep-test")
    fit_with([logger_callback], storage_path)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(logger_callback.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "cb"
    assert run.data.tags["lockstep.latest_checkpoint"].endswith("checkpoint_000001")
    history = client.get_metric_history(logger_callback.run_id, "loss")
    assert sorted((point.step, round(point.value, 4)) for point in history) == [(0, 1.0), (1, 0.5), (2, 0.3333)]


def test_a_ray_tune_style_callback_is_refused() -> None:
    class NotOurs:
        def on_trial_result(self, *args: Any) -> None:
            pass

    with pytest.raises(ValueError, match=r"callbacks\[0\] is a .*NotOurs, not a lockstep.callbacks.Callback"):
        RunConfig(callbacks=[NotOurs()])


# -- one interface -------------------------------------------------------------------------------

HOOKS = sorted(name for name in vars(Callback) if name.startswith(("on_", "after_")))
RUN = RunInfo("unit", "/runs/unit", 2, "/runs/unit/logs")


def test_the_dispatcher_has_one_method_per_callback_hook() -> None:
    assert len(HOOKS) >= 7
    assert sorted(name for name in vars(Listeners) if not name.startswith("_")) == HOOKS


def test_every_hook_the_controller_calls_is_a_callback_hook() -> None:
    called = {
        node.attr
        for module in (controller, attempt_events)
        for node in ast.walk(ast.parse(Path(module.__file__).read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "listeners"
    }
    assert len(called) >= 7 and called <= set(HOOKS), f"not hooks of Callback: {called - set(HOOKS)}"


def test_a_misspelled_hook_is_an_error_not_a_silence() -> None:
    listeners = Listeners(RUN, [Recorder()])
    with pytest.raises(AttributeError):
        listeners.after_reprot(0, {"loss": 1.0})  # type: ignore[attr-defined]


def test_a_user_method_named_almost_like_a_hook_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    class Typo(Recorder):
        def on_chekpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
            pass

        def on_epoch_end(self) -> None:  # a name of its own: no warning
            pass

    with caplog.at_level(logging.WARNING, logger="lockstep"):
        RunConfig(callbacks=[Typo(), Recorder()])
    assert [record.getMessage() for record in caplog.records] == [
        "Typo.on_chekpoint is not a Callback hook, so it is never called: did you mean on_checkpoint?"
    ]


class Exploding(Callback):
    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        raise RuntimeError("a bug in lockstep's own listener")


def test_a_builtin_listener_that_raises_is_a_bug_and_raised_a_user_one_is_switched_off() -> None:
    user, broken = Recorder(), Broken()
    listeners = Listeners(RUN, [broken, user])
    listeners.after_report(0, {"loss": 1.0})
    listeners.after_report(1, {"loss": 0.5})
    assert listeners.callbacks == [user] and user.calls == [("report", 0, 1.0), ("report", 1, 0.5)]
    with pytest.raises(RuntimeError, match="a bug in lockstep's own listener"):
        Listeners(RUN, [user], builtin=[Exploding()]).after_report(2, {"loss": 0.3})


def test_log_lines_tell_each_report_checkpoint_failure_and_restart(caplog: pytest.LogCaptureFixture) -> None:
    listeners = Listeners(RUN, builtin=[LogLines()])
    with caplog.at_level(logging.INFO, logger="lockstep"):
        listeners.after_report(0, {"loss": 1.0})
        listeners.on_checkpoint(0, Checkpoint("/runs/unit/checkpoint_000000"))
        listeners.on_failure(lockstep.TrainingFailedError("rank 1 died"), True)
        listeners.on_attempt_start(AttemptStart(2, 2, "restart", Checkpoint("/runs/unit/checkpoint_000000"), 1, 3))
        listeners.on_failure(lockstep.TrainingFailedError("rank 1 died again"), False)
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        ("INFO", "report #0: loss=1"),
        ("INFO", "checkpoint checkpoint_000000 committed (report #0)."),
        ("WARNING", "rank 1 died"),
        ("WARNING", "Restarting the workers (failure 1 of 3 allowed), from /runs/unit/checkpoint_000000."),
    ]


@pytest.mark.parametrize(
    ("terminal", "verbose", "level"), [(True, None, "DEBUG"), (False, None, "INFO"), (True, 0, "INFO")]
)
def test_report_lines_go_to_debug_where_a_live_progress_line_shows_each_report(
    terminal: bool,
    verbose: int | None,
    level: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(progress, "_is_terminal", lambda stream: terminal)
    listeners = listeners_for(RunConfig(verbose=verbose, callbacks=[Recorder()]), RUN)
    kinds = [type(listener).__name__ for listener in listeners.builtin + listeners.callbacks]
    assert kinds == ["LogLines", *(["ProgressCallback"] if verbose != 0 else []), "Recorder"]
    with caplog.at_level(logging.DEBUG, logger="lockstep"):
        Listeners(RUN, builtin=listeners.builtin[:1]).after_report(4, {"loss": 0.5})
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [(level, "report #4: loss=0.5")]


def test_the_progress_line_follows_the_hooks() -> None:
    stream = io.StringIO()
    line = progress.ProgressCallback("unit", 2, stream)
    listeners = Listeners(RUN, builtin=[line])
    listeners.on_run_start()
    listeners.on_attempt_start(AttemptStart(1, 2, "start", None, 0, 1))
    listeners.on_workers_changed(2)
    listeners.after_report(0, {"loss": 1.0, "note": "text"})
    listeners.on_checkpoint(0, Checkpoint("/runs/unit/checkpoint_000000"))
    listeners.on_attempt_start(AttemptStart(2, 2, "restart", None, 1, 1))
    listeners.on_run_end("failed", None)
    assert stream.getvalue().splitlines() == [  # not a terminal: a plain line on the first report, and at the end
        "lockstep unit | report 0 | 0:00:00 | 2/2 workers | loss=1 note=text",
        "lockstep unit | report 0 | 0:00:00 | 0/2 workers | 1 restart(s) | ckpt checkpoint_000000 "
        "| loss=1 note=text | failed",
    ]
    assert progress._active is None, "an ended run's line is no longer drawn around workers' output"


def test_a_logger_given_to_two_fits_writes_each_runs_own_files(tmp_path: Path) -> None:
    csv_logger, json_logger = CSVLogger(), JSONLogger()
    for name, value in (("lr_0.1", 1.0), ("lr_0.2", 2.0)):
        run = RunInfo(name, str(tmp_path / name), 2, str(tmp_path / name / "logs"))
        for logger in (csv_logger, json_logger):
            logger.on_run_start(run)
            logger.after_report(run, 0, {"loss": value})
            logger.on_run_end(run, "finished", None)
    for name, value in (("lr_0.1", "1.0"), ("lr_0.2", "2.0")):
        logs = tmp_path / name / "logs"
        assert list(csv.DictReader((logs / "metrics.csv").open())) == [{"report_index": "0", "loss": value}]
        assert [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()] == [
            {"report_index": 0, "loss": float(value)}
        ]
